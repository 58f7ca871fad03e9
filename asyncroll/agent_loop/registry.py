"""Agent loops by name, so a recipe's config can pick one.

Invariants: a name names one loop class; registering a taken name is an error unless it is the
same class again (a re-imported module) or ``replace=True``. The table is declarative: it is
filled by ``@register_agent_loop`` at import time and holds no I/O state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from asyncroll.agent_loop.base import AgentLoop
from asyncroll.errors import InvalidRequestError

__all__ = ["agent_loop_class", "register_agent_loop", "registered_agent_loops"]

LoopT = TypeVar("LoopT", bound=type[AgentLoop[Any]])

_LOOPS: dict[str, type[AgentLoop[Any]]] = {}


def register_agent_loop(name: str, *, replace: bool = False) -> Callable[[LoopT], LoopT]:
    """Class decorator: make the loop available as ``run_agent_loops(..., loop=name)``.

    Raises:
        InvalidRequestError: ``name`` already names another loop and ``replace`` is False.
    """

    def register(cls: LoopT) -> LoopT:
        taken = _LOOPS.get(name)
        if taken is not None and not replace and _qualname(taken) != _qualname(cls):
            raise InvalidRequestError(
                f"agent loop {name!r} is already registered to {_qualname(taken)}"
            )
        _LOOPS[name] = cls
        return cls

    return register


def agent_loop_class(name: str) -> type[AgentLoop[Any]]:
    """The loop registered as ``name``.

    Raises:
        InvalidRequestError: no loop has that name.
    """
    try:
        return _LOOPS[name]
    except KeyError:
        known = ", ".join(sorted(_LOOPS))
        raise InvalidRequestError(f"no agent loop named {name!r} (known: {known})") from None


def registered_agent_loops() -> list[str]:
    return sorted(_LOOPS)


def _qualname(cls: type[Any]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
