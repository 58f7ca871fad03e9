"""A small reference trainer: any local Llama / Qwen2 / Qwen3 checkpoint, a GRPO-style step.

Not a training framework: enough to show the rollout layer doing its job, on CPU (CI, the tiny
model) and on GPUs (bf16 mixed precision; one device, or FSDP2 shards through ``wrap``).
Invariants:
- Everything the loss touches lives on the trainer's ``device``: the model, the optimiser's
  state and every tensor built from the samples.
- The loss uses the rollout's own log probs (behaviour policy) with a clipped importance ratio
  per token, so tokens sampled by stale weights (their ``global_steps`` tell how stale) are
  corrected, not trusted.
- Only tokens the model sampled (``loss_mask`` 1) are trained on; tokens an agent loop inserted
  (tool results, mask 0) are context for the tokens after them, never targets.
- ``named_parameters()`` yields Hugging Face checkpoint names in the engines' dtype, ready for
  ``manager.update_weights``; with ``lora``, the base weights are frozen and
  ``adapter_tensors()`` yields the adapter under PEFT's names, ready for
  ``manager.update_adapter``.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from asyncroll.adapters import AdapterConfig
from asyncroll.errors import InvalidRequestError

__all__ = [
    "SUPPORTED_FAMILIES",
    "Precision",
    "ReferenceTrainer",
    "TrainMetrics",
    "TrainSample",
    "LORA_MODULES",
    "check_checkpoint",
    "resolve_device",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSample:
    """One scored rollout; samples of one prompt share a ``group``.

    ``response_ids``, ``log_probs``, ``global_steps`` and ``loss_mask`` have one entry per
    response token (checked when one is made). ``loss_mask`` defaults to all ones (every token
    sampled by the model); an agent loop's ``response_mask`` puts 0 on the tokens it inserted.
    """

    group: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    global_steps: tuple[int | None, ...]
    reward: float
    loss_mask: tuple[int, ...] = ()
    num_preempted: int = 0
    """Weight updates that cut into this sample's generation (the manager resumed it)."""

    def __post_init__(self) -> None:
        if not self.loss_mask:
            object.__setattr__(self, "loss_mask", (1,) * len(self.response_ids))
        lengths = {len(self.response_ids), len(self.log_probs), len(self.global_steps),
                   len(self.loss_mask)}
        if len(lengths) != 1:
            raise InvalidRequestError(
                "response_ids, log_probs, global_steps and loss_mask must have equal lengths, "
                f"got {sorted(lengths)}"
            )
        if not set(self.loss_mask) <= {0, 1}:
            raise InvalidRequestError(f"loss_mask holds 0s and 1s, not {set(self.loss_mask)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainMetrics:
    loss: float
    reward: float
    mean_ratio: float
    clipped_fraction: float
    num_tokens: int = 0
    """Tokens the loss covers (those with ``loss_mask`` 1); 0 where a trainer does not say."""
    log_probs: tuple[float, ...] = ()
    """The trainer's log prob of each token the loss covers, before the step, in batch order
    (sample by sample, mask-1 tokens only): with the rollout's, the mismatch
    (``asyncroll.mismatch``). Empty where a trainer does not say."""


class ReferenceTrainer:
    """GRPO on any local Hugging Face checkpoint of a supported family, on CPU or one GPU (or N
    GPUs, sharded by ``wrap``): group-normalised advantages, PPO-clipped importance ratios.

    Precision: on CUDA, ``"bf16-mixed"`` (the default there): fp32 master weights and fp32
    Adam state, forward and backward under ``torch.autocast`` in bf16, the log probs and the
    loss in fp32, as PyTorch's AMP and most RL trainers do (verl's FSDP, OpenRLHF). bf16
    throughout would halve the optimiser's memory but loses small updates to rounding (bf16
    keeps 8 bits of mantissa: an update below 1/256 of a weight vanishes). On CPU: ``"fp32"``
    throughout (the default there, and what CI runs).

    A batch is cut into micro-batches of at most ``micro_batch_tokens`` tokens (whole samples,
    padded), each run forward and backward before the next, so the logits of a 150k-token
    vocabulary never exist for the whole batch at once; the loss is the mean over the batch's
    trained tokens whatever the cut, and for a sharded model over every rank's trained tokens.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str | torch.device | None = None,
        precision: Precision | None = None,
        lr: float = 3e-3,
        clip: float = 0.2,
        threads: int | None = 1,
        seed: int = 0,
        wrap: Callable[[torch.nn.Module], object] | None = None,
        micro_batch_tokens: int = 16384,
        gradient_checkpointing: bool = False,
        max_grad_norm: float | None = None,
        lora: AdapterConfig | None = None,
        adapter: str = "policy",
    ) -> None:
        """``device``: where the model, the optimiser and every tensor of the loss live (None:
        the current CUDA device when there is one, else the CPU). ``threads``: torch's CPU
        threads, set only when training on the CPU (leave the other cores to the engines).

        ``wrap`` prepares the model before the optimiser sees its parameters: e.g. FSDP2's
        ``fully_shard`` of each layer and the model (``examples/fsdp_hybrid.py``); then
        ``named_parameters`` yields each rank's ``DTensor`` shards, which
        ``DistributedWeightPusher`` gathers as it pushes. The wrapped model must end on
        ``device`` (FSDP2 moves it to its mesh's device).

        ``lora``: train a LoRA adapter of that rank and alpha on every linear layer of the
        decoder (``LORA_MODULES``), the base weights frozen, as PEFT does (A random, B zero:
        the first adapter changes nothing). ``adapter`` names it for the engines
        (``adapter``, ``adapter_tensors``).

        Raises:
            InvalidRequestError: ``model_path`` is not a checkpoint of a supported family
                (``check_checkpoint``), ``device`` does not exist, or an option is out of range.
        """
        from transformers import AutoModelForCausalLM

        path = check_checkpoint(model_path)
        self.device = resolve_device(device)
        self.precision: Precision = check_precision(precision, self.device)
        if micro_batch_tokens < 1:
            raise InvalidRequestError(f"micro_batch_tokens must be >= 1, not {micro_batch_tokens}")
        if threads is not None and self.device.type == "cpu":
            torch.set_num_threads(threads)  # leave the other cores to the engines
        torch.manual_seed(seed)
        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32
        )
        model.config.use_cache = False  # type: ignore[union-attr]
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self._lora: dict[str, _LoRALinear] = {}
        if lora is not None:
            if wrap is not None:
                raise InvalidRequestError("lora trains on one device: not with wrap (FSDP2)")
            self._lora = _add_lora(model, lora)
        if wrap is None:
            model.to(self.device)
        else:
            wrap(model)
            _check_on_device(model, self.device)
        self.model = model
        self.model.train()
        self.adapter: tuple[str, AdapterConfig] | None = (adapter, lora) if lora else None
        """The adapter trained, (name, config), or None (the whole model is trained)."""
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(trained, lr=lr)
        self.clip = clip
        self.micro_batch_tokens = micro_batch_tokens
        self.max_grad_norm = max_grad_norm
        self.steps = 0
        self._sharded = wrap is not None

    def __repr__(self) -> str:
        return (f"<ReferenceTrainer {type(self.model).__name__} on {self.device} "
                f"({self.precision}) steps={self.steps} clip={self.clip}>")

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights as the engines hold them (bf16, checkpoint names); with ``lora``, the
        frozen base weights (the adapter is ``adapter_tensors``)."""
        for name, parameter in self.model.named_parameters():
            if self._lora and name.rsplit(".", 1)[-1] in ("lora_a", "lora_b"):
                continue
            yield name.replace(".base.", "."), parameter.detach().to(torch.bfloat16)

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter under PEFT's names (``base_model.model.<module>.lora_A.weight``),
        bf16, for ``manager.update_adapter``.

        Raises:
            InvalidRequestError: the trainer trains the whole model (no ``lora``).
        """
        if not self._lora:
            raise InvalidRequestError("this trainer trains the whole model: no adapter")
        tensors = {}
        for module, layer in self._lora.items():
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = layer.lora_a.detach().to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = layer.lora_b.detach().to(torch.bfloat16)
        return tensors

    def step(self, samples: Sequence[TrainSample]) -> TrainMetrics:
        """One optimiser step on a batch of scored samples (blocking: run it in a thread).

        Micro-batch by micro-batch, forward and backward; then one optimiser step. A sharded
        model's ranks run the same number of micro-batches (a rank with fewer runs empty ones),
        since each forward gathers parameters across ranks."""
        with self._on_device():
            return self._step(samples)

    def _step(self, samples: Sequence[TrainSample]) -> TrainMetrics:
        ranks = self._ranks()
        # A rank of a sharded model may have nothing to train on (more ranks than groups):
        # it still joins every collective, with empty micro-batches.
        batch = _Batch.of(samples, self.device, allow_empty=ranks > 1)
        chunks = batch.micro_batches(self.micro_batch_tokens)
        rounds, tokens = self._agreed(len(chunks), batch.num_tokens)
        if tokens == 0:
            raise InvalidRequestError("the batch has no token to train on (every mask is 0)")
        # The loss is the mean over every rank's trained tokens: each rank's sum, times the
        # ranks over the whole count, since FSDP averages the ranks' gradients.
        scale = ranks / tokens
        self.optimizer.zero_grad(set_to_none=True)
        parts = []
        for i in range(rounds):
            if i < len(chunks):
                loss, part = self._chunk_loss(batch, chunks[i], scale=scale)
                parts.append(part)
            else:
                loss = self._empty_loss()
            loss.backward()  # type: ignore[no-untyped-call]
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], self.max_grad_norm
            )
        self.optimizer.step()
        self.steps += 1
        return batch.metrics(parts)

    def loss(self, samples: Sequence[TrainSample]) -> tuple[torch.Tensor, TrainMetrics]:
        """The batch's loss (with its graph, the whole batch as one micro-batch) and metrics,
        without stepping.

        Raises:
            InvalidRequestError: no sample has a token with ``loss_mask`` 1.
        """
        with self._on_device():
            batch = _Batch.of(samples, self.device)
            loss, part = self._chunk_loss(batch, range(len(samples)), scale=1 / batch.num_tokens)
            return loss, batch.metrics([part])

    def _chunk_loss(
        self, batch: _Batch, rows: range, *, scale: float
    ) -> tuple[torch.Tensor, _Part]:
        tokens, positions, targets, old, adv = batch.tensors(rows)
        with self._autocast():
            logits = self.model(input_ids=tokens).logits
        picked = logits[positions[:, 0], positions[:, 1]].float()  # (trained tokens, vocab)
        del logits
        new = picked.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(picked, dim=-1)
        ratio = torch.exp(new - old)
        clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
        loss = -torch.minimum(ratio * adv, clipped * adv).sum() * scale
        return loss, _Part(loss.detach(), new.detach(), ratio.detach(), clipped.detach())

    def _empty_loss(self) -> torch.Tensor:
        """A forward of one token whose loss is 0: a rank's share of the collectives."""
        with self._autocast():
            logits = self.model(input_ids=torch.zeros(1, 1, dtype=torch.long,
                                                      device=self.device)).logits
        zero: torch.Tensor = logits.float().sum() * 0.0
        return zero

    def _ranks(self) -> int:
        """Ranks sharing the step: those of the process group of a wrapped model, else 1."""
        if self._sharded and torch.distributed.is_available() and (
            torch.distributed.is_initialized()
        ):
            return torch.distributed.get_world_size()
        return 1

    def _agreed(self, rounds: int, tokens: int) -> tuple[int, int]:
        """Over every rank: the most micro-batches any has, and the trained tokens of all."""
        if self._ranks() == 1:
            return rounds, tokens
        most = torch.tensor([rounds], device=self.device)
        total = torch.tensor([tokens], device=self.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM)
        return int(most.item()), int(total.item())

    def _on_device(self) -> contextlib.AbstractContextManager[object]:
        """CUDA's current device is per thread, and recipes step in a worker thread: FSDP2's
        streams and the collectives' buffers follow the current device, not the model's."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.precision == "bf16-mixed":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


Precision = Literal["bf16-mixed", "fp32"]

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a Llama / Qwen decoder block a LoRA adapter trains (``lora``)."""


class _LoRALinear(torch.nn.Module):
    """A frozen ``nn.Linear`` plus ``B @ A * alpha / rank`` (PEFT's LoRA, without dropout)."""

    def __init__(self, base: torch.nn.Linear, config: AdapterConfig) -> None:
        super().__init__()
        self.base = base
        base.requires_grad_(False)
        self.scale = config.alpha / config.rank
        self.lora_a = torch.nn.Parameter(torch.empty(config.rank, base.in_features))
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, config.rank))
        torch.nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # as PEFT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update: torch.Tensor = (x @ self.lora_a.t().to(x.dtype)) @ self.lora_b.t().to(x.dtype)
        return self.base(x) + update * self.scale  # type: ignore[no-any-return]


def _add_lora(model: torch.nn.Module, config: AdapterConfig) -> dict[str, _LoRALinear]:
    """Freeze ``model`` and put a LoRA on each of its ``LORA_MODULES``; by module path."""
    model.requires_grad_(False)
    added: dict[str, _LoRALinear] = {}
    for path, module in list(model.named_modules()):
        leaf = path.rsplit(".", 1)[-1]
        if leaf in LORA_MODULES and isinstance(module, torch.nn.Linear):
            parent = model.get_submodule(path.rsplit(".", 1)[0])
            layer = _LoRALinear(module, config)
            setattr(parent, leaf, layer)
            added[path] = layer
    if not added:
        raise InvalidRequestError(f"the model has none of {LORA_MODULES} to put a LoRA on")
    return added

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")
"""Hugging Face ``model_type``s the trainer loads and the examples, tests and benchmarks have
run: Llama, Qwen2 / Qwen2.5 and Qwen3 (dense decoder-only models vLLM serves by name)."""


def check_checkpoint(model_path: str | Path) -> Path:
    """``model_path`` as a local Hugging Face checkpoint folder of a supported family.

    Raises:
        InvalidRequestError: not a folder, no ``config.json``, no ``*.safetensors`` weights, or
            a ``model_type`` outside ``SUPPORTED_FAMILIES``; says which.
    """
    path = Path(model_path)
    if not path.is_dir():
        raise InvalidRequestError(f"model {str(path)!r} is not a folder (a local Hugging Face "
                                  "checkpoint: config.json and *.safetensors)")
    config = path / "config.json"
    if not config.is_file():
        raise InvalidRequestError(f"model {str(path)!r} is not a checkpoint: no config.json")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError) as exc:
        raise InvalidRequestError(f"model {str(path)!r}: config.json is not a JSON object") from exc
    if model_type not in SUPPORTED_FAMILIES:
        raise InvalidRequestError(
            f"model {str(path)!r} is a {model_type!r} model; the trainer loads "
            f"{', '.join(SUPPORTED_FAMILIES)}"
        )
    if not any(path.glob("*.safetensors")):
        raise InvalidRequestError(f"model {str(path)!r} has no *.safetensors weights")
    return path


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to train on: ``None`` is the current CUDA device if there is one, else the
    CPU; ``"cuda"`` is the current CUDA device.

    Raises:
        InvalidRequestError: not a device name, a CUDA device where there is none or past the
            last one, or a device type other than ``cpu`` and ``cuda``.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidRequestError(f"device {device!r} is not a device name") from exc
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise InvalidRequestError(f"device {device!r}: the trainer runs on cpu or cuda")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise InvalidRequestError(f"device {device!r}: this machine has no CUDA device")
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if not 0 <= index < count:
        raise InvalidRequestError(
            f"device {device!r} does not exist: this machine has {count} CUDA device(s), "
            f"cuda:0 to cuda:{count - 1}"
        )
    return torch.device("cuda", index)


def check_precision(precision: str | None, device: torch.device) -> Precision:
    """``precision`` checked, or the device's default (bf16-mixed on CUDA, fp32 on CPU)."""
    if precision is None:
        return "bf16-mixed" if device.type == "cuda" else "fp32"
    if precision not in ("bf16-mixed", "fp32"):
        raise InvalidRequestError(f"precision must be 'bf16-mixed' or 'fp32', not {precision!r}")
    return precision  # type: ignore[return-value]


def _check_on_device(model: torch.nn.Module, device: torch.device) -> None:
    for name, parameter in model.named_parameters():
        local = getattr(parameter, "_local_tensor", parameter)  # a DTensor's shard
        if local.device != device:
            raise InvalidRequestError(
                f"the wrapped model's {name} is on {local.device}, not on the trainer's "
                f"device {device}"
            )


@dataclass(frozen=True, slots=True)
class _Part:
    """What one micro-batch contributed (detached)."""

    loss: torch.Tensor
    log_probs: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor


@dataclass(frozen=True, slots=True)
class _Batch:
    """A batch's samples with their advantages, cut into micro-batches of whole samples."""

    samples: Sequence[TrainSample]
    advantages: list[float]
    device: torch.device
    num_tokens: int

    @classmethod
    def of(
        cls, samples: Sequence[TrainSample], device: torch.device, *, allow_empty: bool = False
    ) -> _Batch:
        num_tokens = sum(sum(s.loss_mask) for s in samples)
        if num_tokens == 0 and not allow_empty:
            raise InvalidRequestError("the batch has no token to train on (every mask is 0)")
        return cls(samples, _group_advantages(samples), device, num_tokens)

    def micro_batches(self, budget: int) -> list[range]:
        """Consecutive rows, each run at most ``budget`` padded tokens (at least one row)."""
        cuts, start, width = [], 0, 0
        for row, sample in enumerate(self.samples):
            length = len(sample.prompt_ids) + len(sample.response_ids)
            if row > start and max(width, length) * (row - start + 1) > budget:
                cuts.append(range(start, row))
                start, width = row, 0
            width = max(width, length)
        cuts.append(range(start, len(self.samples)))
        return [rows for rows in cuts if any(sum(self.samples[r].loss_mask) for r in rows)]

    def tensors(self, rows: range) -> tuple[torch.Tensor, ...]:
        samples = [self.samples[r] for r in rows]
        advantages = [self.advantages[r] for r in rows]
        return tuple(t.to(self.device, non_blocking=True) for t in _flatten(samples, advantages))

    def metrics(self, parts: Sequence[_Part]) -> TrainMetrics:
        if not parts:  # a rank with no samples of its own (sharded training)
            reward = sum(s.reward for s in self.samples) / len(self.samples) if self.samples \
                else float("nan")
            return TrainMetrics(loss=0.0, reward=reward, mean_ratio=float("nan"),
                                clipped_fraction=float("nan"))
        ratio = torch.cat([p.ratio for p in parts])
        clipped = torch.cat([p.clipped for p in parts])
        return TrainMetrics(
            loss=float(sum(p.loss for p in parts)),
            reward=sum(s.reward for s in self.samples) / len(self.samples),
            mean_ratio=float(ratio.mean()),
            clipped_fraction=float(((ratio - clipped).abs() > 1e-6).float().mean()),
            num_tokens=len(ratio),
            log_probs=tuple(torch.cat([p.log_probs for p in parts]).tolist()),
        )


def _group_advantages(samples: Sequence[TrainSample]) -> list[float]:
    groups: dict[int, list[float]] = {}
    for sample in samples:
        groups.setdefault(sample.group, []).append(sample.reward)
    stats = {
        g: (sum(r) / len(r), math.sqrt(sum((x - sum(r) / len(r)) ** 2 for x in r) / len(r)))
        for g, r in groups.items()
    }
    return [(s.reward - stats[s.group][0]) / (stats[s.group][1] + 1e-4) for s in samples]


def _flatten(
    samples: Sequence[TrainSample], advantages: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad sequences; index (row, position) of the logits that predict each trained token.

    Every token goes into the input; only mask-1 response tokens become targets."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    tokens = torch.zeros(len(samples), width, dtype=torch.long)
    positions, targets, old, adv = [], [], [], []
    for row, (sample, advantage) in enumerate(zip(samples, advantages, strict=True)):
        sequence = list(sample.prompt_ids) + list(sample.response_ids)
        tokens[row, : len(sequence)] = torch.tensor(sequence)
        start = len(sample.prompt_ids)
        for i, (token, log_prob, bit) in enumerate(
            zip(sample.response_ids, sample.log_probs, sample.loss_mask, strict=True)
        ):
            if not bit:
                continue
            positions.append((row, start + i - 1))
            targets.append(token)
            old.append(log_prob)
            adv.append(advantage)
    return (
        tokens,
        torch.tensor(positions, dtype=torch.long).reshape(-1, 2),
        torch.tensor(targets, dtype=torch.long),
        torch.tensor(old, dtype=torch.float32),
        torch.tensor(adv, dtype=torch.float32),
    )
