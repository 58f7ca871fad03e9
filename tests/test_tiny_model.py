from __future__ import annotations

import hashlib
from pathlib import Path

from asyncroll.testing import make_tiny_model


def _digest(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a1 = _digest(make_tiny_model(tmp_path / "a1", seed=3))
    a2 = _digest(make_tiny_model(tmp_path / "a2", seed=3))
    b = _digest(make_tiny_model(tmp_path / "b", seed=4))
    assert a1 == a2
    assert set(a1) == {"config.json", "generation_config.json", "model.safetensors"}
    assert a1["model.safetensors"] != b["model.safetensors"]
    assert a1["config.json"] == b["config.json"]
