"""Test helpers shipped with asyncroll: tiny local models and a documented fake engine."""

from asyncroll.testing.fake_engine import FakeEngine, FakeWeightUpdater
from asyncroll.testing.tiny_model import TINY_CONFIG, make_tiny_model

__all__ = ["FakeEngine", "FakeWeightUpdater", "TINY_CONFIG", "make_tiny_model"]
