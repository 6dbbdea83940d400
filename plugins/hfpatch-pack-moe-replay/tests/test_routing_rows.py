"""Per-row ``Routing`` helpers: rows out of and into a batch, selection, truncation, the per-row tensor.

A trainer shuffles, splits and re-pads a batch's rows; the routing must follow its rows,
so that a micro-batch's forward replays exactly the routes of its own sequences.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hfpatch_pack_moe_replay import LIVE, Routing, RoutingError, record_routing, replay_routing

from conftest import PACK, PAD, VOCAB
from hfpatch_core.testing import load_model, padded_batch


def _routing(batch: int = 4, seq_len: int = 5, layers: int = 3, top_k: int = 2, experts: int = 16) -> Routing:
    generator = torch.Generator().manual_seed(batch * 100 + seq_len)
    picks = [
        torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(batch * seq_len)])
        for _ in range(layers)
    ]
    return Routing(tuple(picks), batch_size=batch)


def _row(routing: Routing, layer: int, row: int) -> torch.Tensor:
    return routing.layers[layer].reshape(routing.batch_size, routing.seq_len, routing.top_k)[row]


def test_select_takes_rows_in_the_order_given() -> None:
    routing = _routing()
    order = [2, 0, 3]
    selected = routing.select(order)
    assert (selected.batch_size, selected.seq_len, selected.num_layers, selected.top_k) == (3, 5, 3, 2)
    for layer in range(3):
        for position, row in enumerate(order):
            assert torch.equal(_row(selected, layer, position), _row(routing, layer, row))
    assert routing.select(torch.tensor(order)) == selected
    assert routing.select(slice(1, 3)) == routing.select([1, 2])
    assert routing.select(-1) == routing.select(3)
    assert routing.select(torch.tensor([True, False, False, True])) == routing.select([0, 3])
    permutation = torch.randperm(4, generator=torch.Generator().manual_seed(0))
    assert routing.select(permutation).select(permutation.argsort()) == routing


def test_rows_split_a_batch_and_stack_joins_it_again() -> None:
    routing = _routing()
    rows = routing.rows()
    assert [(row.batch_size, row.seq_len) for row in rows] == [(1, 5)] * 4
    assert Routing.stack(rows) == routing
    assert Routing.stack([routing.select([0, 1]), routing.select([2, 3])]) == routing
    # rows of different lengths join a left-padded batch through LIVE rows
    short = rows[1].truncated(3, side="left")
    joined = Routing.stack([rows[0], short], padding_side="left")
    assert torch.equal(_row(joined, 0, 1)[:2], torch.full((2, 2), LIVE))
    assert torch.equal(_row(joined, 0, 1)[2:], _row(routing, 0, 1)[2:])


def test_truncated_is_the_inverse_of_padded() -> None:
    routing = _routing()
    for side in ("left", "right"):
        assert routing.padded(8, side=side).truncated(5, side=side) == routing
    kept = routing.truncated(2)
    assert torch.equal(_row(kept, 1, 3), _row(routing, 1, 3)[:2])
    kept = routing.truncated(2, side="left")
    assert torch.equal(_row(kept, 1, 3), _row(routing, 1, 3)[3:])
    assert routing.truncated(5) == routing


def test_the_per_row_tensor_travels_with_the_batch() -> None:
    routing = _routing()
    tensor = routing.to_tensor()
    assert tensor.shape == (4, 5, 3, 2)
    assert Routing.from_tensor(tensor) == routing
    # what a trainer does to the rows of the tensor is what select does to the routing
    assert Routing.from_tensor(tensor[[3, 1]]) == routing.select([3, 1])
    assert Routing.from_tensor(torch.cat([tensor[:2], tensor[2:]])) == routing
    assert torch.equal(tensor[:, :, 0], routing.layers[0].reshape(4, 5, 2))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda r: r.select([]), "selects no row"),
        (lambda r: r.select([4]), r"out of range for a routing of 4 rows"),
        (lambda r: r.select([-5]), r"out of range"),
        (lambda r: r.select(torch.tensor([True, False])), "a mask of 2 rows"),
        (lambda r: r.select([0.5]), "integer row numbers"),
        (lambda r: r.select("rows"), "takes a row number"),
        (lambda r: r.truncated(0), "between 1 and"),
        (lambda r: r.truncated(6), "use Routing.padded"),
        (lambda r: r.truncated(2, side="middle"), "side must be"),
        (lambda r: Routing.from_tensor(r.to_tensor()[0]), r"expects a \(batch, seq_len, num_layers, top_k\)"),
    ],
)
def test_row_helpers_reject_what_does_not_fit(call: object, message: str) -> None:
    with pytest.raises(RoutingError, match=message):
        call(_routing())  # type: ignore[operator]


def test_a_micro_batch_replays_the_routes_of_its_own_rows(checkpoints: dict[str, Path]) -> None:
    """A batch's routing, split as a trainer splits the batch (shuffled, in chunks), replays
    each chunk exactly as the full batch's replay does."""
    model = load_model(checkpoints["qwen2_moe"], PACK)
    ids, mask = padded_batch(VOCAB, pad_token_id=PAD, seed=5)
    with torch.no_grad(), record_routing(model) as recording:
        model(input_ids=ids, attention_mask=mask)
    routing = recording.routing
    # perturbed router weights route live differently: the replay is what makes the rows agree
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "gate" in name and parameter.dim() == 2:
                parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
    with torch.no_grad(), replay_routing(model, routing):
        full = model(input_ids=ids, attention_mask=mask).logits
    order = [2, 0, 1]
    for chunk in ([2, 0], [1]):
        rows = [order.index(row) for row in chunk]
        chunk_routing = routing.select(order).select(rows)
        with torch.no_grad(), record_routing(model) as inner, replay_routing(model, chunk_routing):
            logits = model(input_ids=ids[chunk], attention_mask=mask[chunk]).logits
        assert inner.routing == chunk_routing
        torch.testing.assert_close(logits, full[chunk], rtol=1e-5, atol=1e-5)
