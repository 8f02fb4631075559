"""Errors in what the user handed over that no strategy changes, so a strategy search stops at the first.

A loss function that returns a vector, a detached loss, token ids outside the model's vocabulary: every candidate
of a search would fail its dry run with the same error, each after building the model, and the search would end
with "no strategy runs" (`status=False`) after `patience` dry runs, where the user needs the error itself. These
checks raise the subclasses below; the dry runner reports them as "user" failures (`dry_runner._classify`) and
the search raises them at once, on every rank (`search._Search.run_trial`). They are still ValueError and
TypeError, so code that caught those before still does.
"""

from __future__ import annotations

__all__ = ["UserCodeError", "UserTypeError", "UserValueError", "as_text", "from_text"]


class UserCodeError(Exception):
    """An error in the user's own objects or data, the same under every strategy."""


class UserValueError(UserCodeError, ValueError):
    """A wrong value from the user's code or data (a loss of the wrong shape, a token id beyond the vocabulary)."""


class UserTypeError(UserCodeError, TypeError):
    """A wrong kind of object from the user's code (a loss function returning a dict)."""


def as_text(error: UserCodeError) -> str:
    """"TypeError: <message>" or "ValueError: <message>": how a dry run reports it (`from_text` reads it back)."""
    return f"{'TypeError' if isinstance(error, TypeError) else 'ValueError'}: {error}"


def from_text(text: str, suffix: str = "") -> UserCodeError:
    """The error `as_text` wrote, its message followed by `suffix`."""
    kind, _, message = text.partition(": ")
    cls = UserTypeError if kind == "TypeError" else UserValueError
    return cls(f"{message or text}{suffix}")
