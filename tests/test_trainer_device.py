"""The reference trainer runs where it is told, in the precision it is told, on any supported
family, and cuts batches into micro-batches without changing the step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncroll import InvalidRequestError
from asyncroll.testing import make_tiny_model
from asyncroll.testing.tiny_model import make_model
from asyncroll.trainer import ReferenceTrainer, TrainSample, check_checkpoint, resolve_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def batch(groups: int = 2, size: int = 3, length: int = 12) -> list[TrainSample]:
    """Scored samples of different lengths (so micro-batches pad differently)."""
    samples = []
    for g in range(groups):
        for i in range(size):
            n = length - i
            samples.append(TrainSample(
                group=g, prompt_ids=(5, 6, 7 + g), response_ids=tuple(range(100 + i, 100 + i + n)),
                log_probs=(-6.0,) * n, global_steps=(0,) * n, reward=float(i),
            ))
    return samples


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: make_tiny_model(root / f, seed=0, family=f) for f in ("qwen2", "qwen3", "llama")}


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_each_family_trains_and_yields_the_checkpoints_names(
    families: dict[str, Path], family: str
) -> None:
    trainer = ReferenceTrainer(families[family], device="cpu", threads=None)
    before = {n: t.clone() for n, t in trainer.named_parameters()}
    metrics = trainer.step(batch())
    assert metrics.num_tokens == sum(len(s.response_ids) for s in batch())
    assert trainer.model.config.model_type == family
    pushed = dict(trainer.named_parameters())
    assert set(pushed) == set(load_file(str(families[family] / "model.safetensors")))
    assert all(t.dtype == torch.bfloat16 for t in pushed.values())
    assert any(not torch.equal(before[n], pushed[n]) for n in pushed), "the step changed nothing"


def test_micro_batches_give_the_same_step_as_one_batch(families: dict[str, Path]) -> None:
    whole = ReferenceTrainer(families["qwen2"], device="cpu", threads=None)
    cut = ReferenceTrainer(families["qwen2"], device="cpu", threads=None, micro_batch_tokens=20)
    samples = batch()
    assert len(cut_rows := _micro_batches(cut, samples)) > 2, cut_rows
    for trainer in (whole, cut):  # compare the gradients (Adam turns noise into whole steps)
        trainer.optimizer.step = lambda *args, **kwargs: None  # type: ignore[method-assign]
    a, b = whole.step(samples), cut.step(samples)
    assert a.loss == pytest.approx(b.loss, rel=1e-5, abs=1e-7)
    assert a.log_probs == pytest.approx(b.log_probs, rel=1e-5, abs=1e-6)
    assert (a.num_tokens, a.mean_ratio) == pytest.approx((b.num_tokens, b.mean_ratio))
    for (name, p), (_, q) in zip(whole.model.named_parameters(), cut.model.named_parameters(),
                                 strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)


def _micro_batches(trainer: ReferenceTrainer, samples: list[TrainSample]) -> list[range]:
    from asyncroll.trainer import _Batch

    return _Batch.of(samples, trainer.device).micro_batches(trainer.micro_batch_tokens)


def test_the_default_precision_follows_the_device(families: dict[str, Path]) -> None:
    trainer = ReferenceTrainer(families["qwen2"], threads=None)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert trainer.device.type == expected
    assert trainer.precision == ("bf16-mixed" if expected == "cuda" else "fp32")
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # master weights


def test_bf16_mixed_computes_in_bf16_and_keeps_fp32_master_weights(
    families: dict[str, Path],
) -> None:
    trainer = ReferenceTrainer(families["qwen2"], device="cpu", precision="bf16-mixed",
                               threads=None)
    seen: list[torch.dtype] = []
    with _recording_output_dtypes(trainer.model.lm_head, seen):
        trainer.step(batch())
    assert seen == [torch.bfloat16]
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    state = next(iter(trainer.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32
    fp32 = ReferenceTrainer(families["qwen2"], device="cpu", precision="fp32", threads=None)
    seen.clear()
    with _recording_output_dtypes(fp32.model.lm_head, seen):
        fp32.step(batch())
    assert seen == [torch.float32]


class _recording_output_dtypes:
    def __init__(self, module: torch.nn.Module, seen: list[torch.dtype]) -> None:
        self.module, self.seen = module, seen

    def __enter__(self) -> None:
        self.handle = self.module.register_forward_hook(
            lambda _m, _i, out: self.seen.append(out.dtype)
        )

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


@pytest.mark.parametrize(
    ("device", "match"),
    [
        ("tpu", "not a device name|runs on cpu or cuda"),
        ("meta", "runs on cpu or cuda"),
        ("cuda:64", "does not exist|no CUDA device"),
        ("not a device", "not a device name"),
    ],
)
def test_a_device_that_does_not_exist_is_refused(device: str, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        resolve_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_where_there_is_none_is_refused(families: dict[str, Path]) -> None:
    with pytest.raises(InvalidRequestError, match="no CUDA device"):
        ReferenceTrainer(families["qwen2"], device="cuda")


def test_options_out_of_range_are_refused(families: dict[str, Path]) -> None:
    with pytest.raises(InvalidRequestError, match="precision"):
        ReferenceTrainer(families["qwen2"], device="cpu", precision="fp8")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="micro_batch_tokens"):
        ReferenceTrainer(families["qwen2"], device="cpu", micro_batch_tokens=0)


def test_what_is_not_a_checkpoint_is_refused_naming_why(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="is not a folder"):
        check_checkpoint(tmp_path / "missing")
    with pytest.raises(InvalidRequestError, match=r"no config.json"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(InvalidRequestError, match="not a JSON object"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(InvalidRequestError, match="'gpt2' model; the trainer loads llama, qwen2"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(InvalidRequestError, match=r"no \*\.safetensors"):
        check_checkpoint(tmp_path)


def test_real_shapes_are_written_without_building_the_model(tmp_path: Path) -> None:
    shape = dict(family="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=1000,
                 tie_word_embeddings=True)
    folder = make_model(tmp_path / "m", shape, seed=3)
    tensors = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # tied: the embedding serves both
    assert tensors["model.layers.0.self_attn.q_norm.weight"].eq(1).all()
    assert tensors["model.embed_tokens.weight"].shape == (1000, 64)
    assert json.loads((folder / "config.json").read_text())["architectures"] == [
        "Qwen3ForCausalLM"
    ]
    trainer = ReferenceTrainer(folder, device="cpu", threads=None)
    assert set(dict(trainer.named_parameters())) == set(tensors)
    with pytest.raises(InvalidRequestError, match="unknown shape"):
        make_model(tmp_path / "x", "qwen9-1t")


@cuda
def test_on_cuda_everything_the_loss_touches_is_on_the_device(families: dict[str, Path]) -> None:
    trainer = ReferenceTrainer(families["qwen2"], device="cuda")
    metrics = trainer.step(batch())
    assert metrics.num_tokens > 0
    assert {p.device.type for p in trainer.model.parameters()} == {"cuda"}
    state = next(iter(trainer.optimizer.state.values()))
    assert state["exp_avg"].device.type == "cuda"
    assert {t.device.type for _, t in trainer.named_parameters()} == {"cuda"}
