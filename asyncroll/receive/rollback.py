"""What one worker needs to undo a push that fails, and what it keeps for the next: without vLLM.

A push into a model that serves requests either lands whole or leaves the previous weights in
force. ``Rollback`` keeps what undoing takes, chosen at ``begin``:
- a ``direct`` load (the model's own ``load_weights``, copying into the served parameters)
  with a backup clones the model's parameters and buffers, and a failed push copies them back;
- a load through a re-processing loader (vLLM's layerwise reload: kernel formats the model
  cannot copy back) keeps a checkpoint-format copy, the ``shadow``: read from the checkpoint
  once, then updated by every push that succeeds with the copies it kept of what it loaded.
  A failed push reloads the shadow (the caller's ``restore``);
- without a backup nothing is kept: a push that failed after it touched the model leaves it
  ``mixed`` (the engine then admits nothing until a push succeeds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

__all__ = ["LOADED", "Rollback"]

logger = logging.getLogger(__name__)

LOADED = torch.empty(0, device="cpu")
"""What ``pending`` keeps of a tensor when no copy is kept (only its name counts)."""

Restore = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


class Rollback:
    """Per update: ``begin``, ``loading`` then ``loaded`` for each batch, then ``commit`` or
    ``abort``. Between updates it keeps the shadow (see the module doc)."""

    def __init__(self) -> None:
        self.active = False
        """An update is in progress (``begin`` to ``commit`` or ``abort``)."""
        self.touched = False
        """The update in progress has handed tensors to the model's loader."""
        self.pending: dict[str, torch.Tensor] = {}
        """What the update in progress loaded: copies where the shadow needs them, else
        ``LOADED``."""
        self.shadow: dict[str, torch.Tensor] | None = None
        """Checkpoint-format copy of the served weights (re-processing loads with a backup):
        what a rollback reloads, and what completes a layer a partial update touched but did
        not fill. A kernel-format copy cannot do either: the CPU build keeps repacked weights
        outside the parameters (oneDNN handles), so copying parameters back does not restore
        them."""
        self.unknown = False
        """A push landed without updating the shadow: the checkpoint no longer describes the
        served weights (until a push of every checkpoint tensor seeds the shadow again)."""
        self.mixed = False
        """A push failed without a backup: the served weights are partly loaded."""
        self._backup: dict[str, torch.Tensor] | None = None
        """The backup of the update in progress (direct loads): ``_saved``, filled at ``begin``."""
        self._saved: dict[str, torch.Tensor] = {}
        """Where backups go, kept from one update to the next: each ``begin`` copies the
        served state in with one fused copy, where a clone per tensor allocated and launched a
        copy for each of them every update."""
        self._keeps_copies = False
        self._prepared = False
        """``_saved`` holds the served state already (``prepare``): the next direct ``begin``
        with a backup copies nothing."""

    def prepare(self, model: torch.nn.Module) -> None:
        """Copy the served state into the backup ahead of the next ``begin`` (which then
        copies nothing): on a thread of the caller's own while the model serves (it only reads
        the model), after the last update ended and before the next begins. On a GPU the copy
        is queued on the caller's stream: the caller waits for it before that ``begin``."""
        self._saved = _copy_state(model, self._saved)
        self._prepared = True

    def begin(
        self,
        model: torch.nn.Module,
        *,
        backup: bool,
        direct: bool,
        checkpoint: Callable[[], dict[str, torch.Tensor] | None],
    ) -> None:
        """Start an update: take what undoing it needs (``checkpoint()`` reads the served
        weights' checkpoint, for a first shadow)."""
        self.active = True
        self.touched = False
        self.pending = {}
        self._backup = None
        self._keeps_copies = backup and not direct
        prepared, self._prepared = self._prepared, False
        if not backup:
            self.shadow = None  # it would go stale: this push does not keep copies
            self._saved = {}  # nor its memory
        elif direct:
            if not prepared:
                self._saved = _copy_state(model, self._saved)
            self._backup = self._saved
        elif self.shadow is None and not self.unknown:
            self.shadow = checkpoint()

    def can_roll_back(self, *, backup: bool, direct: bool) -> bool:
        """Whether a push that fails now can be undone: a backup is kept (direct loads), or a
        copy of the served weights is known (read from the checkpoint, or kept from earlier
        pushes, unless one without a backup left the weights unknown)."""
        if not backup:
            return False
        return direct or self.shadow is not None or not self.unknown

    @property
    def keeps_copies(self) -> bool:
        """The update in progress keeps a copy of what it loads (for the shadow)."""
        return self._keeps_copies

    def loading(self) -> None:
        """A batch goes to the model's loader: from here on a failure may leave it partly
        loaded."""
        self.touched = True

    def loaded(self, batch: Sequence[tuple[str, torch.Tensor]]) -> None:
        """A batch is in the model."""
        for name, tensor in batch:
            self.pending[name] = tensor.detach().clone() if self._keeps_copies else LOADED

    def placed(self, name: str) -> None:
        """A tensor goes straight to its place in the model (the load plan's ``place``)."""
        self.touched = True
        self.pending[name] = LOADED

    def commit(self, covers_checkpoint: Callable[[Mapping[str, torch.Tensor]], bool]) -> None:
        """The update landed: keep what it loaded in the shadow (a whole checkpoint's worth
        seeds one)."""
        self.active = self.mixed = False
        self._backup = None
        self._prepared = False  # the served state changed
        if self.shadow is not None:
            self.shadow.update(self.pending)
        elif self._keeps_copies and covers_checkpoint(self.pending):
            self.shadow, self.unknown = dict(self.pending), False  # a whole model arrived
        elif self.pending:
            self.unknown = True
        self.pending = {}

    def abort(
        self,
        model: torch.nn.Module,
        *,
        end: Callable[[], None] | None = None,
        restore: Restore | None = None,
    ) -> bool:
        """End an update in progress, if any: ``end()`` closes the loader's work (a
        re-processing load), then the previous weights come back: the shadow through
        ``restore``, or the backup copied in. Returns whether the weights served now are whole
        (previous, or untouched)."""
        if not self.active:
            return not self.mixed
        self.active = False
        touched, self.touched = self.touched, False
        self.pending = {}
        if end is not None:
            end()
        if self.shadow is not None and restore is not None:
            restore(self.shadow.items())
            logger.warning("weight push failed: previous weights reloaded from the backup")
            return True
        if self._backup is not None:
            state = _state(model)
            with torch.no_grad():
                for name, saved in self._backup.items():
                    if name in state:  # aliases (tied weights) appear once in the state
                        state[name].copy_(saved)
            self._backup = None
            logger.warning("weight push failed: previous weights restored")
            return True
        if touched:
            self.unknown = self.mixed = True
            logger.error("weight push failed without a backup: the model holds mixed weights")
        return not self.mixed


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _copy_state(
    model: torch.nn.Module, saved: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers copied into ``saved`` (one fused copy), or into new
    tensors where ``saved`` does not match them (a first backup, a changed model)."""
    state = {name: tensor.detach() for name, tensor in _state(model).items()}
    if saved.keys() != state.keys() or any(
        s.shape != t.shape or s.dtype != t.dtype or s.device != t.device
        for s, t in zip(saved.values(), (state[n] for n in saved), strict=True)
    ):
        return {name: tensor.clone() for name, tensor in state.items()}
    with torch.no_grad():
        torch._foreach_copy_(list(saved.values()), [state[name] for name in saved])
    return saved
