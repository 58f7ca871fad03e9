"""Every test in this folder runs twice, on asyncio's event loop and on uvloop's, each in a fresh
loop of its own (``loop_scope="function"`` in the tests' marker). pytest-asyncio owns the loops;
this hook only names the kinds. (The hook applies to the tests below this conftest only: the
rest of the suite shares one session loop with the real engines.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
