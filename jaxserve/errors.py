"""Errors shared across layers: a leaf module that imports nothing from jaxserve."""

from __future__ import annotations

from typing import Any

# Longest repr of a bad value quoted in an error message.
_MAX_QUOTE = 60


class ValidationError(ValueError):
    """A field broke its rule. `str(e)` is `"{field}={value}: {limit}"`.

    Attributes:
      field: the field at fault, e.g. "top_k" or "stop_token_ids[3]".
      param: the top-level field name (for OpenAI's error `param`).
      value: the offending value.
      limit: what the value must satisfy, in words.
    """

    def __init__(self, field: str, value: Any, limit: str, *, shown: str | None = None):
        self.field, self.value, self.limit = field, value, limit
        self.param = field.split("[", 1)[0].split(".", 1)[0]
        super().__init__(f"{field}={quote(value) if shown is None else shown}: {limit}")


def quote(value: Any) -> str:
    """repr of `value`, cut to a readable length for error messages."""
    s = repr(value)
    return s if len(s) <= _MAX_QUOTE else s[:_MAX_QUOTE - 3] + "..."


class EngineSleepingError(RuntimeError):
    """A request was refused because the engine is asleep and refuses new work
    (`LLMEngine.sleep(..., reject_new=True)`, or the offline `LLM` while asleep);
    the server answers 503."""
