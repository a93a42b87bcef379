"""The segmented LoRA matmul against its row-by-row oracle, and the row grouping it reads."""

import pytest
import torch

from prefixserve.replica.lora.sgmv import LoRAMapping, add_lora, add_lora_reference


@pytest.mark.parametrize(
    "slots",
    [
        [0, 0, 0, 0, 0],  # one adapter on every row: the gather-free path
        [-1, 1, 1, 0, -1, 2, 0, 0, 1, -1],  # three adapters and the base, interleaved
        [2, -1, -1],
    ],
)
def test_add_lora_matches_row_by_row(slots: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    t, d_in, d_out, rank, num_slots = len(slots), 12, 10, 4, 3
    x = torch.randn(t, d_in, generator=gen)
    y = torch.randn(t, d_out, generator=gen)
    a = torch.randn(num_slots, rank, d_in, generator=gen)
    b = torch.randn(num_slots, d_out, rank, generator=gen)
    token_slots = torch.tensor(slots)
    mapping = LoRAMapping.from_token_slots(token_slots)
    assert mapping is not None
    expected = add_lora_reference(y, x, a, b, token_slots)
    got = add_lora(y.clone(), x, a, b, mapping)
    torch.testing.assert_close(got, expected)
    # Base rows are left exactly as they were.
    base = token_slots < 0
    assert torch.equal(got[base], y[base])


def test_base_only_batch_has_no_mapping() -> None:
    assert LoRAMapping.from_token_slots(torch.tensor([-1, -1, -1])) is None


def test_mapping_groups_rows_by_slot() -> None:
    mapping = LoRAMapping.from_token_slots(torch.tensor([1, -1, 0, 1]))
    assert mapping is not None and mapping.full is None
    assert [(s, rows.tolist()) for s, rows in mapping.groups] == [(0, [2]), (1, [0, 3])]
