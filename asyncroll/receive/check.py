"""What a push loaded, checked against what was pushed: one worker's check, without vLLM.

``PushCheck`` runs after a push's last batch is loaded and before it is acknowledged:
- every tensor that arrived reached the model's loader (or the place the load plan put it),
  and some did (``check_delivered``): a push never loads less than it delivered in silence;
- every tensor found whole in the model (a parameter of that name, or the one contiguous range
  the load plan copies it to, of the pushed dtype and shape) matches the sender's fingerprint
  (``asyncroll.fingerprints``); one the model holds fused or repacked is checked as it arrived
  (``arrived``), which also catches a tensor the trainer changed while the push read it.
A mismatch is a ``WeightSyncError`` that names the tensors; the caller rolls the push back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import torch

from asyncroll.errors import WeightSyncError
from asyncroll.fingerprints import Fingerprinter, fingerprints, holds_exactly
from asyncroll.receive.load_plan import LoadPlan
from asyncroll.transport.receiver import ReceiveReport

__all__ = ["PushCheck", "check_delivered"]

logger = logging.getLogger(__name__)

Received = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
"""Per tensor that arrived: its pushed dtype and (whole) shape."""


class PushCheck:
    """The check of one worker's pushes into ``model`` (see the module doc).

    Per push: ``begin``; ``note_arrived`` for batches the model holds in another form once
    loaded (layerwise loads); optionally ``read_early`` once every tensor is loaded; then
    ``verify``. With a load plan, the tensors to read are found once per plan generation.
    """

    def __init__(self) -> None:
        self._fingerprinter = Fingerprinter()
        self._key: object = None
        self._targets: tuple[dict[str, torch.Tensor], dict[str, torch.dtype]] = ({}, {})
        self._arrived: dict[str, bytes] = {}
        self.verified = (0, 0)
        """The last push's tensors checked against the sender's fingerprints, and those that
        could not be (not found whole in the model: fused, sharded or converted)."""
        self.seconds = 0.0
        """What the last ``verify`` took."""

    @property
    def early_reads(self) -> int:
        """How many checks read the loaded tensors early (``read_early``)."""
        return self._fingerprinter.early_reads

    def begin(self) -> None:
        """A new push: an early read is this push's, or none."""
        self._fingerprinter.discard_early()
        self._arrived = {}

    def discard(self) -> None:
        """The push failed: drop an early read."""
        self._fingerprinter.discard_early()

    def note_arrived(self, batch: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Fingerprint tensors as they arrive (those the model holds fused or repacked cannot
        be found whole after the load)."""
        self._arrived.update(fingerprints(dict(batch)))

    def read_early(self, plan: LoadPlan | None, received: Received) -> None:
        """Queue the check's read of the loaded tensors behind the loads, before the device
        sync that precedes the ack (``Fingerprinter.read_early``), where the check will look at
        the same tensors as the last push's (same plan generation, same names and shapes).
        Call only where nothing changes the loaded tensors between the loads and the check."""
        key = self._key
        if (
            plan is None
            or not isinstance(key, tuple)
            or key[:2] != (id(plan), plan.generation)
            or key[3] != received
        ):
            return
        found, as_pushed = self._targets
        try:
            self._fingerprinter.read_early(found, as_pushed)
        except Exception:  # only a head start: the check reads them itself
            logger.debug("could not queue the fingerprint read early", exc_info=True)
            self._fingerprinter.discard_early()

    def verify(
        self,
        model: torch.nn.Module,
        plan: LoadPlan | None,
        report: ReceiveReport,
        received: Received,
    ) -> None:
        """Check every tensor found whole in ``model`` (through ``plan`` where it places the
        tensor) against the sender's fingerprint; record ``verified`` and ``seconds``.

        Raises:
            WeightSyncError: a loaded tensor differs from the pushed one, or one arrived other
                than it was fingerprinted before the pause (names them).
        """
        started = time.perf_counter()
        try:
            self._compare(model, plan, report, received)
        finally:
            self.seconds = time.perf_counter() - started

    def _compare(
        self, model: torch.nn.Module, plan: LoadPlan | None, report: ReceiveReport,
        received: Received,
    ) -> None:
        pushed = report.fingerprints
        if not pushed:
            self.verified = (0, 0)
            self._key = None  # (no early reads while pushes come unchecked)
            return
        key = (id(plan), plan.generation, pushed.keys(), received) if plan is not None else None
        if key is not None and self._key == key:
            found, as_pushed = self._targets  # the same mapping: the same objects
        else:
            found, as_pushed = {}, {}
            for name, (dtype, shape) in received.items():
                if name in pushed:
                    tensor = loaded_whole(model, plan, name, dtype, shape)
                    if tensor is not None and tensor.numel():
                        found[name], as_pushed[name] = tensor, dtype
            # Cached only with a plan: its targets change only with its generation (the
            # model's parameters, looked up by name, may be replaced by any reload).
            self._key = key
            self._targets = (found, as_pushed)
        wrong = self._fingerprinter.differing(found, pushed, as_pushed)
        arrived = [n for n in pushed if n in received and n not in found and n in self._arrived]
        torn = [n for n in arrived if self._arrived[n] != pushed[n]]
        self.verified = (len(found) + len(arrived), len(pushed) - len(found) - len(arrived))
        if torn:
            raise WeightSyncError(
                f"push {report.push} (version {report.version}): {len(torn)} tensors arrived"
                f" other than they were before the pause (changed while update_weights read"
                f" them? they must not change until it returns): {_shown(torn)}"
            )
        if wrong:
            raise WeightSyncError(
                f"push {report.push} (version {report.version}): {len(wrong)} loaded tensors"
                f" differ from what was pushed (fingerprints): {_shown(wrong)}"
            )


def loaded_whole(
    model: torch.nn.Module,
    plan: LoadPlan | None,
    name: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
) -> torch.Tensor | None:
    """Where pushed tensor ``name`` sits whole in ``model``, if it does; else None."""
    if plan is not None and plan.knows(name):
        return plan.whole_target(name, dtype, shape)
    try:
        parameter = model.get_parameter(name)
    except AttributeError:
        return None
    with torch._C.DisableTorchFunctionSubclass():
        if not holds_exactly(parameter.dtype, dtype) or tuple(parameter.shape) != shape:
            return None
        return parameter if parameter.is_contiguous() else None


def check_delivered(report: ReceiveReport, received: set[str], handed: set[str]) -> None:
    """Every tensor that arrived reached the model's loader (or the place the load plan put
    it), and some did.

    Raises:
        WeightSyncError: a push that loaded nothing, or less than it delivered (naming what
            was lost): never a silent no-op.
    """
    lost = sorted(received - handed)
    if report.tensors and not handed:
        raise WeightSyncError(
            f"push {report.push} (version {report.version}) delivered {report.tensors} tensors"
            " and the worker loaded none of them"
        )
    if lost:
        raise WeightSyncError(
            f"push {report.push} (version {report.version}): {len(lost)} of"
            f" {len(received)} tensors arrived but never reached the model's loader:"
            f" {_shown(lost)}"
        )


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
