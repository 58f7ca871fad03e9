"""The package root re-exports the public API with a sorted, complete __all__."""

from __future__ import annotations

import asyncroll
import asyncroll.agent_loop
import asyncroll.recipes
import asyncroll.transport


def test_all_is_sorted_and_complete() -> None:
    for module in (asyncroll, asyncroll.transport, asyncroll.agent_loop, asyncroll.recipes):
        names = module.__all__
        assert list(names) == sorted(names), f"{module.__name__}.__all__ is not sorted"
        assert all(hasattr(module, name) for name in names)
        public = {
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and getattr(value, "__module__", "").startswith("asyncroll")
        }
        assert public <= set(names), f"not in {module.__name__}.__all__: {public - set(names)}"


def test_errors_form_one_tree() -> None:
    errors = [getattr(asyncroll, n) for n in asyncroll.__all__ if n.endswith("Error")]
    assert all(issubclass(e, asyncroll.AsyncrollError) for e in errors)
    assert issubclass(asyncroll.InvalidRequestError, ValueError)
    assert issubclass(asyncroll.TransportTimeoutError, TimeoutError)
