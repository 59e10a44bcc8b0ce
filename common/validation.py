"""The check every config dataclass's __post_init__ runs on its fields."""

from __future__ import annotations


def require(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ok (the message names the field and the bad value)."""
    if not ok:
        raise ValueError(message)
