"""Errors the engine raises for bad input: each names the problem and, where there is one, the file."""


class EngineError(Exception):
    """Base class: anything a person can fix by changing the model folder, the prompt or a setting."""


class ModelLoadError(EngineError):
    """The model folder is missing a file, holds a bad file, or describes an unsupported model."""

    def __init__(self, message: str, path=None):
        self.message = message  # without the path
        self.path = str(path) if path is not None else None
        super().__init__(f"{message} ({self.path})" if self.path else message)


class CapacityError(EngineError):
    """A prompt plus its token budget does not fit the KV cache."""


class TemplateError(EngineError):
    """The chat template failed to render (it raised, or used something the sandbox forbids)."""
