"""Everything that speaks to vLLM, and where a change belongs:

- ``engine``: the engine adapter (generation, validation, the admission gate, pause, resume,
  sleep, typed errors, version labels) and its weight port (``VLLMEngine.weights``: the
  engine's half of an update, mapped onto vLLM's weight-update protocol).
- ``worker``: the worker's half, imported inside vLLM's worker processes: asyncroll's
  transport as a vLLM weight-transfer backend (receive, load, verify, roll back).
- ``compat``: the differences between vLLM versions, detected by feature.
- ``sockets``: where vLLM's own IPC sockets go.

The trainer's half of an update (the sequence, the pushers) is ``asyncroll.weights`` and
``asyncroll.distributed``, beside this package, never imported by it. Nothing outside this folder
imports vLLM."""

from asyncroll.vllm.engine import VLLMEngine, VLLMWeightPort, parse_version, version_label

__all__ = ["VLLMEngine", "VLLMWeightPort", "parse_version", "version_label"]
