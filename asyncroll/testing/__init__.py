"""Test helpers shipped with asyncroll: tiny local models and a documented fake engine."""

from asyncroll.testing.fake_engine import FakeEngine, FakeWeightUpdater
from asyncroll.testing.scripted import scripted_weights
from asyncroll.testing.tiny_model import (
    CHAT_TEMPLATE,
    REASONING_DROPPING_TEMPLATE,
    TINY_CONFIG,
    make_tiny_model,
)

__all__ = [
    "CHAT_TEMPLATE",
    "REASONING_DROPPING_TEMPLATE",
    "TINY_CONFIG",
    "FakeEngine",
    "FakeWeightUpdater",
    "make_tiny_model",
    "scripted_weights",
]
