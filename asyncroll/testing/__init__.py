"""Test helpers shipped with asyncroll: tiny local models and a documented fake engine."""

from asyncroll.testing.tiny_model import TINY_CONFIG, make_tiny_model

__all__ = ["TINY_CONFIG", "make_tiny_model"]
