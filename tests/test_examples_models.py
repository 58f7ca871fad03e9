"""The examples train any supported local checkpoint (``--model``), and refuse bad arguments
before any engine starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncroll.testing import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run(*args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, check=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: make_tiny_model(root / family, seed=0, family=family)  # type: ignore[arg-type]
            for family in ("qwen3", "llama")}


@pytest.mark.engine
@pytest.mark.parametrize(
    ("script", "family", "extra"),
    [("fully_async.py", "qwen3", ()), ("synchronous.py", "llama", ("--hybrid",))],
)
def test_an_example_trains_a_local_checkpoint_of_another_family(
    checkpoints: dict[str, Path], tmp_path: Path, script: str, family: str, extra: tuple[str, ...]
) -> None:
    plot = tmp_path / "plot.png"
    done = run(EXAMPLES / script, "--model", checkpoints[family], "--steps", "3", "--plot", plot,
               *extra)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    architecture = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[family]
    assert f"{architecture} ({family})" in done.stdout  # what ran is said first
    assert "trainer on the CPU" in done.stdout and "(CPU build)" in done.stdout
    assert "reward: random policy 0.062" in done.stdout
    assert done.stdout.count("\n   2  ") == 1  # the table's third step
    assert plot.stat().st_size > 10_000


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--model", "/nonexistent/model"), "is not a folder"),
        (("--device", "cuda:9"), "no CUDA device|does not exist"),
        (("--device", "tpu"), "runs on cpu or cuda|not a device name"),
        (("--steps", "0"), "must be at least 1"),
    ],
)
def test_bad_arguments_stop_an_example_before_any_engine_starts(
    args: tuple[str, ...], message: str
) -> None:
    done = run(EXAMPLES / "demo.py", *args, timeout=120)
    assert done.returncode != 0
    assert "error: " in done.stderr
    assert re.search(message, done.stderr), done.stderr
    assert "starting the engine" not in done.stdout


@pytest.mark.process
def test_a_model_of_an_unsupported_family_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    done = run(EXAMPLES / "fully_async.py", "--model", tmp_path, timeout=120)
    assert done.returncode != 0 and "'gpt2' model" in done.stderr
    assert "starting the engine" not in done.stdout


@pytest.mark.process
def test_the_sharded_example_refuses_bad_arguments_on_every_rank(tmp_path: Path) -> None:
    done = run(EXAMPLES / "fsdp_hybrid.py", timeout=120)
    assert done.returncode != 0 and "run under torchrun" in done.stderr
    # Each rank alone, as torchrun starts it: one that joined a process group before its
    # check would wait for the other rank until the timeout. (Under torchrun itself, the
    # first rank to fail has the others killed, perhaps before they say why.)
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": "29533"}
        command = [sys.executable, str(EXAMPLES / "fsdp_hybrid.py"), "--model",
                   str(tmp_path / "missing")]
        done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env,
                              cwd=ROOT, check=False)
        assert done.returncode != 0
        assert "is not a folder" in done.stderr, (rank, done.stderr[-3000:])
