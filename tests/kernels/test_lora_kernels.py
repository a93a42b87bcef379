"""The segmented LoRA matmul against its row-by-row oracle, and the row grouping it reads."""

import pytest
import torch

from prefixserve.kernels.reference_lora import BATCHED_MAX_ROWS, LoRAMapping, add_lora, add_lora_reference


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


@pytest.mark.parametrize("rows", [3, BATCHED_MAX_ROWS, BATCHED_MAX_ROWS + 1])
@pytest.mark.parametrize("adapters", [(0, 1), (1, 2)])  # the buffers' leading slots, or a gather of them
def test_the_batched_order_of_small_batches_matches_row_by_row(rows: int, adapters: tuple[int, int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    d_in, d_out, rank, num_slots = 12, 10, 4, 3
    choices = torch.tensor([-1, *adapters])
    slots = choices[torch.randint(0, 3, (rows,), generator=gen)]
    slots[:2] = torch.tensor(adapters)  # both adapters present: not the one-adapter path
    x = torch.randn(rows, d_in, generator=gen)
    y = torch.randn(rows, d_out, generator=gen)
    a = torch.randn(num_slots, rank, d_in, generator=gen)
    b = torch.randn(num_slots, d_out, rank, generator=gen)
    mapping = LoRAMapping.from_token_slots(slots)
    assert mapping is not None and mapping.full is None
    batched = mapping.batched
    assert (batched is not None) == (rows <= BATCHED_MAX_ROWS)
    assert batched is None or batched.leading == (adapters == (0, 1))
    got = add_lora(y.clone(), x, a, b, mapping)
    torch.testing.assert_close(got, add_lora_reference(y, x, a, b, slots))
    base = slots < 0
    assert torch.equal(got[base], y[base])


def test_base_only_batch_has_no_mapping() -> None:
    assert LoRAMapping.from_token_slots(torch.tensor([-1, -1, -1])) is None


def test_mapping_groups_rows_by_slot() -> None:
    mapping = LoRAMapping.from_token_slots(torch.tensor([1, -1, 0, 1]))
    assert mapping is not None and mapping.full is None
    assert [(s, rows.tolist()) for s, rows in mapping.groups] == [(0, [2]), (1, [0, 3])]


@pytest.mark.parametrize(
    ("dtype", "d_in", "d_out", "rank"),
    [
        (torch.float32, 12, 10, 4),
        (torch.float32, 200, 70, 24),
        (torch.bfloat16, 64, 130, 16),
        (torch.float16, 40, 8, 8),
    ],
)
def test_triton_add_lora_matches_the_reference(dtype, d_in: int, d_out: int, rank: int, seed: int) -> None:
    """The Triton kernels under TRITON_INTERPRET (conftest) against the row-by-row oracle:
    interleaved adapters and base rows, dims not multiples of the tiles."""
    from prefixserve.kernels.triton.lora import triton_add_lora

    gen = torch.Generator().manual_seed(seed)
    slots = torch.tensor([-1, 1, 1, 0, -1, 2, 0])
    x = torch.randn(len(slots), d_in, generator=gen).to(dtype)
    y = torch.randn(len(slots), d_out, generator=gen).to(dtype)
    a = (torch.randn(3, rank, d_in, generator=gen) / d_in**0.5).to(dtype)
    b = torch.randn(3, d_out, rank, generator=gen).to(dtype)
    expected = add_lora_reference(y.float(), x.float(), a.float(), b.float(), slots)
    got = triton_add_lora(y.clone(), x, a, b, slots)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)
    assert torch.equal(got[slots < 0], y[slots < 0])  # base rows untouched


def test_triton_add_lora_rejects_mismatched_shapes() -> None:
    from prefixserve.kernels.triton.lora import triton_add_lora

    x, y = torch.zeros(3, 8), torch.zeros(3, 4)
    with pytest.raises(ValueError, match="shapes do not fit"):
        triton_add_lora(y, x, torch.zeros(2, 2, 8), torch.zeros(2, 5, 2), torch.zeros(3, dtype=torch.long))
