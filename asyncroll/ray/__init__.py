"""Engines on a Ray cluster, routed and updated like local ones (the ``ray`` extra).

``RayEngine`` puts a ``VLLMEngine`` in a Ray actor and speaks the same engine protocols, so
``AsyncServerManager`` routes over local and Ray engines alike and pushes weights into both.
"""

from asyncroll.ray.engine import EngineHost, RayEngine

__all__ = ["EngineHost", "RayEngine"]
