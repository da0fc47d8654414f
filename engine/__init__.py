"""kvchat's inference engine: plain PyTorch, no Qt. The public API:

from engine import LoadSpec, Request, SamplingParams, Session, load_model
loaded = load_model()                      # the bundled demo model; or a folder
session = Session(loaded)
for event in session.generate(Request(messages=[{"role": "user", "content": "Hi"}])):
    ...                                    # engine.events: PrefillStarted, Token, Finished, ...
"""

from .sampling import SamplingParams
from .session import Request, Session
from .spec import LoadSpec
from .weights.loading import LoadedModel, load_model

__all__ = ["LoadSpec", "LoadedModel", "Request", "SamplingParams", "Session", "load_model"]
