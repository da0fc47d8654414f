"""Errors the engine raises for bad input: each names the problem and, where there is one, the file; and the
cutting of words from outside (a Hub's, a file's) to a size an error message may carry."""


def cut(text: str, limit: int) -> str:
    """`text` of at most `limit` characters, an ellipsis marking a cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def one_line(text, limit: int = 300) -> str:
    """The first line of `text`, at most `limit` characters: outside words shown in a note or on stderr."""
    stripped = str(text).strip()
    return cut(stripped.splitlines()[0] if stripped else "", limit)


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
