"""Pieces put together into whole tensors (``asyncroll.receive.assembly``), for a worker fed by
every trainer rank whose loader takes whole tensors only."""

from __future__ import annotations

import pytest
import torch

from asyncroll.receive.assembly import Assembly
from asyncroll.transport.plan import Part


def test_each_ranks_rows_in_any_order_make_the_tensor_once_all_arrived() -> None:
    whole = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    assembly = Assembly()
    pieces = [(whole[3:], Part(whole=(6, 4), offset=12)), (whole[:3], Part(whole=(6, 4), offset=0))]
    batch, parts, _ = assembly.take([("w", pieces[0][0].clone()), ("b", torch.ones(2))],
                                    {"w": pieces[0][1]})
    assert [name for name, _ in batch] == ["b"] and parts == {}  # w waits for its other rows
    assert assembly.incomplete == ["w"]
    batch, parts, _ = assembly.take([("w", pieces[1][0].clone())], {"w": pieces[1][1]})
    (name, made), = batch
    assert name == "w" and torch.equal(made, whole) and parts == {}
    assert assembly.incomplete == []


def test_column_blocks_make_the_tensor() -> None:
    whole = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    assembly = Assembly()
    left = (whole[:, :2].contiguous(), Part(whole=(4, 6), offset=0, columns=(0, 2)))
    right = (whole[:, 2:].contiguous(), Part(whole=(4, 6), offset=0, columns=(2, 6)))
    assert assembly.take([("o", left[0])], {"o": left[1]})[0] == []
    (_, made), = assembly.take([("o", right[0])], {"o": right[1]})[0]
    assert torch.equal(made, whole)


def test_pieces_the_loader_takes_stay_pieces_and_pieces_not_needed_leave() -> None:
    assembly = Assembly()
    piece, other = torch.ones(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16)
    part, other_part = Part(whole=(4, 4), offset=0), Part(whole=(4, 4), offset=8)
    routes = {"q": "load", "k": "skip"}
    batch, parts, skipped = assembly.take(
        [("q", piece), ("k", other)], {"q": part, "k": other_part},
        route=lambda name, tensor, where: routes[name])  # type: ignore[arg-type,return-value]
    assert batch == [("q", piece)] and parts == {"q": part}
    assert skipped == [("k", torch.bfloat16, (4, 4))]
    assert assembly.incomplete == []


def test_a_piece_that_does_not_fit_or_overfills_is_refused() -> None:
    assembly = Assembly()
    with pytest.raises(ValueError, match="does not fit"):
        assembly.take([("w", torch.ones(8))], {"w": Part(whole=(2, 4), offset=4)})
    assembly = Assembly()
    assembly.take([("w", torch.ones(4))], {"w": Part(whole=(2, 4), offset=0)})
    with pytest.raises(ValueError, match="more than its 8 elements"):
        assembly.take([("w", torch.ones(6))], {"w": Part(whole=(2, 4), offset=0)})
