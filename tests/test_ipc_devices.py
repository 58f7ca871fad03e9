"""A CUDA IPC handle opens on a device the receiver has: a receiver started on one GPU of
several sees it as device 0, whatever index the sender's process gave it."""

from __future__ import annotations

import pytest
import torch

from asyncroll.transport.backends import on_local_device


def args(device: int) -> tuple[object, ...]:
    return ("cls", (4,), (1,), 0, "storage", torch.uint8, device, b"handle", 4, 0, False)


def test_an_index_the_receiver_lacks_becomes_its_current_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert on_local_device(args(3), devices=1)[6] == 0  # the engine sees only the trainer's GPU
    assert on_local_device(args(3), devices=1)[7:] == args(3)[7:]
    assert on_local_device(args(1), devices=4) == args(1)  # an index it has: left as is
    assert on_local_device(args(0), devices=1) == args(0)
