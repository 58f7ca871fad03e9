"""Moved to ``asyncroll.vllm.engine`` (kept so old imports work; use ``asyncroll.VLLMEngine``)."""

import warnings

from asyncroll.vllm.engine import VLLMEngine, parse_version, version_label

__all__ = ["VLLMEngine", "parse_version", "version_label"]

warnings.warn(
    "asyncroll.engine moved to asyncroll.vllm.engine; import VLLMEngine from asyncroll",
    DeprecationWarning,
    stacklevel=2,
)
