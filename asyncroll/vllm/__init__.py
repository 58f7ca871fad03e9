"""Everything that speaks to vLLM: the engine adapter (``engine``), the worker half of the weight
transfer (``worker``, imported inside vLLM's worker processes), and the version differences
between them (``compat``). Nothing outside this folder imports vLLM."""

from asyncroll.vllm.engine import VLLMEngine, parse_version, version_label

__all__ = ["VLLMEngine", "parse_version", "version_label"]
