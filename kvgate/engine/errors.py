"""What the engine raises to its callers beyond a plain ValueError (bad input).

AdmissionRefused        nothing was queued; retry after ``retry_after_s``
  ├── EngineOverloaded      every live replica's waiting queue is full
  └── EngineUnavailable     every replica is stalled or failed
EngineStepError         the step computing this request failed; its blocks are freed and
                        the replica keeps serving, so a retry may well succeed
InvalidArgument         (a ValueError) a bad sampling field: ``field`` names it (``temperature``,
                        ``stop``, ``structured_outputs``, an unknown field's own name), so a
                        front door need not read it out of the message
TooManyTokens           (a ValueError) a prompt or text over a token limit, often found
                        from its length alone, before tokenizing it
AdapterError            (a ValueError) a LoRA adapter folder that cannot be served; the
  └── AdapterNotFound       message names the file or tensor / no adapter at that path
UnknownAdapter          (an InvalidArgument on ``model``) a request names an adapter not loaded
"""

from __future__ import annotations


class AdmissionRefused(Exception):
    reason = "refused"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[object, ...]:  # crosses the engine process's socket
        return type(self), (str(self), self.retry_after_s)


class EngineOverloaded(AdmissionRefused):
    reason = "overloaded"


class EngineUnavailable(AdmissionRefused):
    reason = "unavailable"


class EngineStepError(RuntimeError):
    """The engine step that was computing this request raised."""


class InvalidArgument(ValueError):
    """A request field the caller must change; the message says how, ``field`` names it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[object, ...]:
        return InvalidArgument._rebuild, (type(self), str(self), self.field, self.__dict__)

    @staticmethod
    def _rebuild(
        cls: type[InvalidArgument], message: str, field: str, state: dict[str, object]
    ) -> InvalidArgument:
        """A subclass with another ``__init__`` (``UnknownAdapter``) comes back whole too."""
        exc = cls.__new__(cls)
        ValueError.__init__(exc, message)
        exc.__dict__.update(state)
        exc.field = field
        return exc


class TooManyTokens(ValueError):
    """A text (or prompt) has more tokens than a limit allows — counted, or ``at_least`` so
    many as its byte length shows without tokenizing it (``Tokenizer.min_tokens``)."""

    def __init__(self, message: str, at_least: int, limit: int) -> None:
        super().__init__(message)
        self.at_least = at_least
        self.limit = limit

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (str(self), self.at_least, self.limit)


class AdapterError(ValueError):
    """A LoRA adapter that cannot be served; the message names the file or tensor."""


class AdapterNotFound(AdapterError):
    """No adapter at that path (vLLM answers it with a 404)."""


class UnknownAdapter(InvalidArgument):
    """A request names an adapter that is not loaded (the OpenAI ``model`` field)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.", "model")
        self.name = name


class ModelLoadError(ValueError):
    """A checkpoint folder the engine cannot use; the message names the offending piece."""
