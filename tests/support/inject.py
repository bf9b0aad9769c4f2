"""Failures injected after a call took effect: what a read timeout after the server applied it
looks like to the caller."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Timeout(RuntimeError):
    """What the call raised once its effect had landed."""


def after_effect(owner: Any, method: str, when: Callable[..., bool] = lambda *a: True) -> list[tuple[Any, ...]]:
    """Make `owner.method` take effect, then raise `Timeout`, once (where `when(*args)` holds).
    Returns the arguments of the call that failed, once it has."""
    real, failed = getattr(owner, method), []

    def call(*args: Any) -> Any:
        result = real(*args)
        if not failed and when(*args):
            failed.append(args)
            raise Timeout(f"{method}: no answer (it took effect)")
        return result

    setattr(owner, method, call)
    return failed
