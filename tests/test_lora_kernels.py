"""The LoRA shrink/expand kernels (ember/kernels/lora.py) against a float64 reference on fresh random inputs.

Without a GPU they run in Triton's interpreter on tiny shapes; on a GPU the same tests run compiled. The
slot patterns put every kind of row tile in front of the segmented form (tiles of SEGMENT_ROWS rows): one
adapter throughout, a tile of the base alone, a tile split between requests, a last tile cut short by the
batch's end, every tile mixed (a decode batch of round-robin adapters), and a decode-sized batch, which
the gathered form does alone. Ranks 8 (below tl.dot's 16, masked) and 16; one slice and three (q/k/v
fused, each its own column offset, all in one expand launch) in an output wider than the slices, whose
other columns stay put. The shrink fused into the base GEMM (FusedShrink: every slot's A under W) with the
expand reading each row's own slot's columns of the GEMM's strided tail, in float32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE

from ember.kernels.lora import (
    SEGMENT_ROWS,
    SEGMENTED_MIN_ROWS,
    lora_expand,
    lora_expand_slots,
    lora_ref,
    lora_shrink,
)
from ember.ops.lora import FusedShrink, stacked_slices

NUM_SLOTS, IN_FEATURES = 3, 40
M = SEGMENT_ROWS


def _runs(*runs: tuple[int, int]) -> list[int]:
    """Slots as (slot, count) runs: the rows of consecutive requests."""
    return [slot for slot, count in runs for _ in range(count)]


# tiles of M rows: [adapter 2] [2 | base] [base] [adapter 0, short]
REQUESTS = _runs((2, M + 3), (-1, 2 * M - 3), (0, 9))
SLOT_PATTERNS = {
    "one-adapter": _runs((1, 2 * M + 5)),
    "requests": REQUESTS,
    "round-robin": [(0, 1, 2, -1)[t % 4] for t in range(2 * M + 6)],
    "decode": [1, -1, 1, 0, 2],
}


def _delta_inputs(
    slots: list[int], rank: int, widths: list[int], dtype: torch.dtype, seed: int, in_features: int = IN_FEATURES
):
    """x, A, per-slice B (one buffer, `stacked_slices`) and the slots, values O(1) after both products."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(NUM_SLOTS, len(widths) * rank, in_features, generator=gen) * in_features**-0.5
    x = torch.randn(len(slots), in_features, generator=gen)
    b = stacked_slices(NUM_SLOTS, rank, widths, dtype, KERNEL_DEVICE)
    for bi in b:
        bi.copy_(torch.randn(bi.shape, generator=gen) * rank**-0.5)
    x, a = (t.to(dtype=dtype, device=KERNEL_DEVICE) for t in (x, a))
    return x, a, b, torch.tensor(slots, dtype=torch.int32, device=KERNEL_DEVICE)


def _apply(x: torch.Tensor, a: torch.Tensor, b: list[torch.Tensor], slots: torch.Tensor, y: torch.Tensor):
    """Shrink, then every slice's expand into its columns of y, as TritonLoRA does; returns the shrink's xa."""
    xa = lora_shrink(x, a, slots)
    lora_expand(xa, b, slots, y)
    return xa


def test_patterns_reach_both_forms():
    """The batches above the threshold run the segmented form (with some whole tiles), the decode one not."""
    assert all(len(s) >= SEGMENTED_MIN_ROWS for name, s in SLOT_PATTERNS.items() if name != "decode")
    assert len(SLOT_PATTERNS["decode"]) < SEGMENTED_MIN_ROWS and len(REQUESTS) % M != 0


@pytest.mark.parametrize("rank,widths", [(8, [24]), (8, [24, 8, 8]), (16, [24, 8, 8])])
@pytest.mark.parametrize("pattern", list(SLOT_PATTERNS))
def test_shrink_and_expand_match_reference(pattern: str, rank: int, widths: list[int]):
    x, a, b, slots = _delta_inputs(SLOT_PATTERNS[pattern], rank, widths, torch.float32, seed=rank + len(widths))
    base = torch.randn(len(slots), sum(widths) + 8, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    y = base.clone()
    xa = _apply(x, a, b, slots, y)
    live = (slots >= 0)[:, None]
    want_xa = torch.einsum("tnk,tk->tn", a[slots.clamp(min=0).long()].double(), x.double()) * live
    assert xa.dtype == torch.float32 and xa.shape[1:] == (len(slots), len(widths) * rank)
    torch.testing.assert_close(xa.double().sum(0), want_xa, atol=1e-5, rtol=1e-5)
    want = base.double()
    want[:, : sum(widths)] += lora_ref(x, a, b, slots)
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_reference(dtype: torch.dtype):
    """bf16/fp16 inputs and output: the segmented form's products in the inputs' dtype (xa rounded to it for
    the expand), the output rounded once."""
    x, a, b, slots = _delta_inputs(REQUESTS, 16, [24, 8, 8], dtype, seed=7)
    base = torch.randn(len(slots), 40, generator=torch.Generator().manual_seed(2)).to(dtype=dtype, device=KERNEL_DEVICE)
    y = base.clone()
    _apply(x, a, b, slots, y)
    want = base.double() + lora_ref(x, a, b, slots)
    torch.testing.assert_close(y.double(), want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("pattern", ["decode", "requests"])
def test_split_k_partials_add_up(pattern: str):
    """A wide input (K = 600) in few programs is split into parts (the last one short), whose sum the
    expand takes: the same delta as the reference, in both forms."""
    x, a, b, slots = _delta_inputs(SLOT_PATTERNS[pattern], 16, [24, 8, 8], torch.float32, seed=3, in_features=600)
    base = torch.randn(len(slots), 40, generator=torch.Generator().manual_seed(4)).to(KERNEL_DEVICE)
    y = base.clone()
    xa = _apply(x, a, b, slots, y)
    assert xa.shape[0] > 1
    torch.testing.assert_close(y.double(), base.double() + lora_ref(x, a, b, slots), atol=1e-5, rtol=1e-5)


def test_gathered_expand_walks_column_tiles(monkeypatch):
    """With few programs allowed, one gathered-expand program walks several column tiles of its row, across
    the slices' boundaries (inside a tile and between tiles; the last one cut short): the same delta."""
    from ember.kernels import lora

    monkeypatch.setattr(lora, "EXPAND_PROGRAMS", 4)
    x, a, b, slots = _delta_inputs(SLOT_PATTERNS["decode"], 8, [150, 106, 44], torch.float32, seed=5)
    base = torch.randn(len(slots), 300, generator=torch.Generator().manual_seed(6)).to(KERNEL_DEVICE)
    y = base.clone()
    _apply(x, a, b, slots, y)
    torch.testing.assert_close(y.double(), base.double() + lora_ref(x, a, b, slots), atol=1e-5, rtol=1e-5)


def _fused(x: torch.Tensor, a: torch.Tensor, n: int, seed: int) -> tuple[FusedShrink, torch.Tensor, torch.Tensor]:
    """A base projection W [n, K] with a bias, and every slot's A stacked under it (FusedShrink)."""
    gen = torch.Generator().manual_seed(seed)
    k = x.shape[1]
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype=x.dtype, device=KERNEL_DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype=x.dtype, device=KERNEL_DEVICE)
    fused = FusedShrink.stack(w, bias, a.shape[0] * a.shape[1])
    fused.a(a.shape[0]).copy_(a)  # as an adapter's load writes its slot
    return fused, w, bias


@pytest.mark.parametrize("rank,widths", [(8, [24]), (16, [24, 8, 8])])
@pytest.mark.parametrize("pattern", list(SLOT_PATTERNS))
def test_fused_shrink_matches_reference(pattern: str, rank: int, widths: list[int]):
    """One GEMM of [W ; A] gives the base's output and every slot's shrink; the expand of each row's own
    slot's columns (strided rows of the GEMM's tail) into the base's columns: the base plus each row's
    delta. The base's rows are left as the GEMM wrote them."""
    x, a, b, slots = _delta_inputs(SLOT_PATTERNS[pattern], rank, widths, torch.float32, seed=11 + rank)
    fused, w, bias = _fused(x, a, sum(widths), seed=12)
    y, xa = fused(x)
    assert xa.shape == (len(slots), NUM_SLOTS * len(widths) * rank) and y.stride(0) == xa.stride(0) != y.shape[1]
    before = y.clone()
    lora_expand_slots(xa, b, slots, y)
    want = F.linear(x.double(), w.double(), bias.double()) + lora_ref(x, a, b, slots)
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)
    base_rows = slots < 0
    assert torch.equal(y[base_rows], before[base_rows])


def test_fused_shrink_in_bf16():
    """bf16: the shrink comes out of the GEMM rounded to bf16 (as punica rounds it to the activations' dtype),
    each output rounded once more after the delta: within bf16's rounding of the float64 reference."""
    x, a, b, slots = _delta_inputs(REQUESTS, 16, [24, 8, 8], torch.bfloat16, seed=13)
    fused, w, bias = _fused(x, a, 40, seed=14)
    y, xa = fused(x)
    lora_expand_slots(xa, b, slots, y)
    want = F.linear(x.double(), w.double(), bias.double()) + lora_ref(x, a, b, slots)
    torch.testing.assert_close(y.double(), want, atol=3e-2, rtol=2e-2)


def test_fused_shrink_keeps_the_base_weight():
    """The base's weight and bias as views of the stacked buffer's head: the same values, and an adapter's A
    written through `a` lands under them, in the rows the GEMM's tail comes from."""
    x, a, _, _ = _delta_inputs(SLOT_PATTERNS["decode"], 8, [24, 8, 8], torch.float32, seed=15)
    fused, w, bias = _fused(x, a, 40, seed=16)
    assert torch.equal(fused.base_weight, w) and fused.base_bias is not None and torch.equal(fused.base_bias, bias)
    assert fused.base_weight.data_ptr() == fused.weight.data_ptr() and fused.base_weight.is_contiguous()
    torch.testing.assert_close(fused(x)[1], x @ a.reshape(-1, x.shape[1]).T, atol=1e-6, rtol=1e-6)


def test_expand_refuses_slices_apart():
    """B's slices in separate buffers: the one launch could not address them."""
    x, a, b, slots = _delta_inputs(SLOT_PATTERNS["decode"], 8, [24, 8, 8], torch.float32, seed=17)
    with pytest.raises(ValueError, match="one after another"):
        apart = [bi.clone() for bi in b]
        lora_expand(lora_shrink(x, a, slots), apart, slots, torch.zeros(len(slots), 40, device=KERNEL_DEVICE))
