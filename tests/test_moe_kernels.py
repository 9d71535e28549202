"""The fused MoE kernels (routing, alignment, grouped GEMMs, fused_moe) against torch references.

Without a GPU they run in Triton's interpreter on tiny shapes; on a GPU the same tests run
compiled. Every GEMM result is held to a float32 product of the dequantized experts on fresh
random inputs, including experts that receive no tokens, every token routed to one expert, M = 1,
and tiles that split N, K and the sorted slots into several blocks.
"""

from __future__ import annotations

import importlib
import json
import os
import zlib

import pytest
import torch

# The interpreter is chosen when the kernels are decorated, so this must precede the imports below.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ember.kernels.fused_moe import fused_moe, fused_moe_from_logits, fused_moe_ref, grouped_gemm, weight_kind
from ember.kernels.moe_align import max_padded_slots, moe_align_block_size, route_and_align
from ember.kernels.moe_config import (
    FUSED_MAX_TOKENS,
    FusedTiles,
    GemmTiles,
    MoeConfig,
    choose_moe_config,
    default_fused_tiles,
    default_moe_config,
    device_key,
    lookup,
    problem_key,
)
from ember.kernels.moe_routing import moe_route, moe_route_ref
from ember.kernels.split_k import tile_counters
from ember.quant.experts import QuantizedExperts, quantize_experts
from ember.quant.formats import pack_int4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Outputs are O(1); bf16/fp16 round the activations, the intermediate and the output.
TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
    torch.bfloat16: {"atol": 4e-2, "rtol": 4e-2},
}
# Small tiles: several N tiles, K tiles and sorted-slot blocks even on these tiny shapes.
SMALL_TILES = MoeConfig(16, GemmTiles(16, 16, 2, 1), GemmTiles(16, 32, 2, 1))
# M = 1's down and sum over k in one kernel, in N tiles narrower than tl.dot takes and several K tiles.
BY_TOKEN_TILES = SMALL_TILES._replace(down_by_token=GemmTiles(8, 16, 2, 1))
# The whole MLP in one kernel: several 16-row slices of I, 16-column K steps and 32-row chunks of H
# (ragged at the end).
FUSED_TILES = SMALL_TILES._replace(fused=FusedTiles(16, 16, 32, 2, 1))


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(*shape: int, gen: torch.Generator, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def _routing(m: int, e: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random experts per token and weights summing to 1, built without the kernels under test."""
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)]).to(torch.int32)
    weights = torch.softmax(torch.randn(m, k, generator=gen), dim=-1)
    return weights.to(DEVICE), ids.to(DEVICE)


def _random_experts(
    kind: str, e: int, n: int, k: int, group: int, zeros: bool, gen: torch.Generator
) -> QuantizedExperts:
    """Random codes over the kind's range, scaled so x @ w.T is O(1) for x ~ N(0, 1); int4 zeros
    centre the unsigned codes, as GGUF's Q4 mins and load-time int4 do."""
    groups = -(-k // group)
    if kind == "int8":
        qweight, levels = torch.randint(-128, 128, (e, n, k), generator=gen, dtype=torch.int8), 128
    else:
        qweight, levels = pack_int4(torch.randint(0, 16, (e * n, k), generator=gen)).view(e, n, -1), 8
    scales = (0.5 + torch.rand(e, n, groups, generator=gen)) / (levels * k**0.5)
    offsets = None
    if zeros:
        centre = -8 * scales if kind == "int4" else 0
        offsets = centre + torch.randn(e, n, groups, generator=gen) * scales
    return QuantizedExperts(kind, qweight, scales, offsets, group, k).to(DEVICE)


def _experts(kind: str, e: int, h: int, inter: int, gen: torch.Generator):
    """(w13, w2) of one storage kind: a torch dtype, or quantized 'int8-channel', 'int8-g16', 'int4-g16',
    'int4-g32', 'fp8-channel'."""
    if isinstance(kind, torch.dtype):
        return _randn(e, 2 * inter, h, gen=gen, scale=h**-0.5, dtype=kind), _randn(
            e, h, inter, gen=gen, scale=inter**-0.5, dtype=kind
        )
    name, form = kind.split("-")
    if name == "fp8":
        return (
            quantize_experts(_randn(e, 2 * inter, h, gen=gen, scale=h**-0.5), "fp8"),
            quantize_experts(_randn(e, h, inter, gen=gen, scale=inter**-0.5), "fp8"),
        )
    zeros = name == "int4" or form != "channel"
    group13, group2 = (h, inter) if form == "channel" else (int(form[1:]),) * 2
    return (
        _random_experts(name, e, 2 * inter, h, group13, zeros, gen),
        _random_experts(name, e, h, inter, group2, zeros, gen),
    )


# --- routing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("m,e,k", [(1, 8, 2), (9, 10, 3), (3, 128, 8)])
def test_route_matches_reference(m: int, e: int, k: int, renormalize: bool) -> None:
    gen = _gen("route", m, e, k, renormalize)
    logits = _randn(m, e, gen=gen) * 3
    logits[0, [1, e // 2, e - 1]] = logits[0].max() + 1  # a three-way tie for first place
    weights, ids = moe_route(logits, k, renormalize)
    ref_weights, ref_ids = moe_route_ref(logits, k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (m, k)
    assert torch.equal(ids, ref_ids)
    tied = min(k, 3)
    assert ids[0, :tied].tolist() == [1, e // 2, e - 1][:tied]  # ties go to the lower index
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
    chosen = torch.softmax(logits.float().cpu(), -1).gather(1, ids.long().cpu())
    expected_sums = torch.ones(m) if renormalize else chosen.sum(1)
    torch.testing.assert_close(weights.sum(1).cpu(), expected_sums, atol=1e-6, rtol=1e-5)


def test_route_rejects_bad_top_k() -> None:
    with pytest.raises(ValueError, match="top_k"):
        moe_route(torch.zeros(2, 4, device=DEVICE), 5, True)


# --- alignment -----------------------------------------------------------------------------------


def _check_alignment(topk_ids: torch.Tensor, e: int, block_m: int) -> None:
    align = moe_align_block_size(topk_ids, e, block_m)
    ids = topk_ids.flatten().cpu().long()
    num_slots = ids.numel()
    counts = torch.bincount(ids, minlength=e)
    total = int(((counts + block_m - 1) // block_m * block_m).sum())
    sorted_ids = align.sorted_token_ids.cpu().long()
    expert_ids = align.expert_ids.cpu().long()
    assert sorted_ids.numel() == max_padded_slots(num_slots, e, block_m) == expert_ids.numel() * block_m
    assert int(align.num_tokens_post_padded) == total
    real = sorted_ids[sorted_ids < num_slots]
    assert torch.equal(real.sort().values, torch.arange(num_slots))  # every slot once
    assert torch.all(sorted_ids[sorted_ids >= num_slots] == num_slots)  # padding is the sentinel
    assert torch.all(sorted_ids[total:] == num_slots) and torch.all(expert_ids[total // block_m :] == -1)
    blocks = sorted_ids[:total].view(-1, block_m)
    for b, expert in enumerate(expert_ids[: total // block_m].tolist()):
        slots = blocks[b][blocks[b] < num_slots]
        assert slots.numel() > 0 and torch.all(ids[slots] == expert)  # one expert per block, none empty
        assert torch.all(slots[1:] > slots[:-1])  # slot order within an expert: deterministic
    assert expert_ids[: total // block_m].tolist() == sorted(expert_ids[: total // block_m].tolist())


@pytest.mark.parametrize(
    "m,e,k,block_m", [(13, 7, 3, 4), (1, 8, 2, 16), (30, 128, 8, 16), (40, 4, 2, 64), (600, 8, 2, 16)]
)
def test_alignment_groups_slots_by_expert(m: int, e: int, k: int, block_m: int) -> None:
    gen = _gen("align", m, e, k)
    _check_alignment(_routing(m, e, k, gen)[1], e, block_m)


def test_alignment_all_tokens_to_one_expert() -> None:
    _check_alignment(torch.full((37, 1), 5, dtype=torch.int32, device=DEVICE), 8, 16)


# (M, E, k, BLOCK_M): decode at the Qwen3-30B-A3B width (one launch up to M = 8), a top-k that is
# not a power of two, Mixtral's 8 experts (one launch up to 512 tokens), and sizes past one launch.
ROUTE_ALIGN_CASES = [(1, 128, 8, 16), (8, 128, 8, 16), (5, 10, 3, 4), (300, 8, 2, 16), (9, 128, 8, 16), (600, 8, 2, 64)]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("m,e,k,block_m", ROUTE_ALIGN_CASES)
def test_route_and_align_equals_the_two_steps(m: int, e: int, k: int, block_m: int, renormalize: bool) -> None:
    """The one-launch routing + alignment gives exactly moe_route's weights and ids and
    moe_align_block_size's layout of them, whichever path it takes."""
    logits = _randn(m, e, gen=_gen("route-align", m, e, k, block_m, renormalize)) * 3
    weights, ids, align = route_and_align(logits, k, renormalize, block_m)
    ref_weights, ref_ids = moe_route(logits, k, renormalize)
    ref_align = moe_align_block_size(ref_ids, e, block_m)
    assert torch.equal(ids, ref_ids)
    # Equal in the interpreter; compiled, the fused kernel's softmax sums may be laid out apart: an ulp.
    torch.testing.assert_close(weights, ref_weights, atol=0, rtol=0 if INTERPRETED else 3e-7)
    assert align.block_m == ref_align.block_m
    for got, want in zip(align[:3], ref_align[:3], strict=True):
        assert torch.equal(got, want)
    _check_alignment(ids, e, block_m)


def test_fused_moe_from_logits_equals_fused_moe() -> None:
    """Routing inside fused_moe_from_logits changes nothing downstream: bit for bit fused_moe's result."""
    gen = _gen("from-logits")
    m, e, k, h, inter = 3, 16, 4, 32, 32
    w13, w2 = _experts(torch.bfloat16, e, h, inter, gen)
    hidden, logits = _randn(m, h, gen=gen, dtype=torch.bfloat16), _randn(m, e, gen=gen)
    out = fused_moe_from_logits(hidden, w13, w2, logits, k, True)
    assert torch.equal(out, fused_moe(hidden, w13, w2, *moe_route(logits, k, True)))


# --- grouped GEMMs and fused_moe -----------------------------------------------------------------


def test_grouped_gemms_match_per_slot_products() -> None:
    """gate_up gives silu(gate) * up per slot, down the routing weight times the product, before the sum."""
    gen = _gen("grouped")
    m, e, k, h, inter = 7, 5, 2, 48, 40
    w13, w2 = _experts(torch.float32, e, h, inter, gen)
    x = _randn(m, h, gen=gen)
    weights, ids = _routing(m, e, k, gen)
    align = moe_align_block_size(ids, e, SMALL_TILES.block_m)
    act = torch.empty(m * k, inter, device=DEVICE)
    grouped_gemm(x, w13, act, align, SMALL_TILES.gate_up, k)
    slot_experts = ids.flatten().long()
    gate_up = torch.einsum("sh,snh->sn", x.repeat_interleave(k, 0), w13[slot_experts])
    expected_act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(act, expected_act, **TOL[torch.float32])
    y = torch.empty(m * k, h, device=DEVICE)
    grouped_gemm(act, w2, y, align, SMALL_TILES.down, 1, weights.flatten())
    expected_y = torch.einsum("si,shi->sh", act, w2[slot_experts]) * weights.flatten()[:, None]
    torch.testing.assert_close(y, expected_y, **TOL[torch.float32])


def _check_fused(
    hidden: torch.Tensor, w13, w2, weights: torch.Tensor, ids: torch.Tensor, config: MoeConfig | None, tol: dict
) -> None:
    out = fused_moe(hidden, w13, w2, weights, ids, config=config)
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    ref = fused_moe_ref(hidden.double(), w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), ref, **tol)


# (weight kind, activation dtype, M, E, k, H, I, config): M = 1 (most experts get nothing), ragged
# H and I, each quantized form with groups that split K into several tiles, and one batch whose
# slots span several alignment chunks.
CASES = [
    (torch.float32, torch.float32, 1, 8, 2, 64, 48, None),
    (torch.float32, torch.float32, 9, 6, 2, 40, 24, SMALL_TILES),
    (torch.float32, torch.float32, 9, 128, 8, 32, 16, None),  # 72 slots: the three-kernel alignment
    (torch.bfloat16, torch.bfloat16, 5, 8, 3, 64, 32, None),
    (torch.float16, torch.float16, 17, 4, 2, 32, 48, SMALL_TILES),
    ("int8-channel", torch.float32, 6, 5, 2, 64, 48, SMALL_TILES),
    ("int8-g16", torch.bfloat16, 4, 6, 2, 64, 32, None),
    ("int4-g16", torch.float32, 7, 5, 2, 64, 48, SMALL_TILES),
    ("int4-g32", torch.bfloat16, 1, 8, 2, 64, 64, None),
    ("int4-g32", torch.bfloat16, 5, 6, 2, 64, 64, SMALL_TILES),  # 16-column K tiles, raised for int4 (INT4_MMA_MIN_K)
    ("fp8-channel", torch.float32, 6, 4, 2, 32, 48, SMALL_TILES),
    ("fp8-channel", torch.bfloat16, 3, 6, 2, 64, 32, None),
]


@pytest.mark.parametrize(
    "kind,dtype,m,e,k,h,inter,config",
    CASES,
    ids=[
        f"{c[0] if isinstance(c[0], str) else str(c[0])[6:]}-{str(c[1])[6:]}-M{c[2]}-E{c[3]}"
        f"-k{c[4]}{'-small' if c[7] else ''}"
        for c in CASES
    ],
)
def test_fused_moe_matches_reference(
    kind, dtype: torch.dtype, m: int, e: int, k: int, h: int, inter: int, config: MoeConfig | None
) -> None:
    gen = _gen("fused", kind, dtype, m, e, k)
    w13, w2 = _experts(kind, e, h, inter, gen)
    weights, ids = _routing(m, e, k, gen)
    _check_fused(_randn(m, h, gen=gen, dtype=dtype), w13, w2, weights, ids, config, TOL[dtype])


@pytest.mark.parametrize(
    "kind,dtype,e,k,h,inter",
    [
        (torch.float32, torch.float32, 8, 3, 40, 48),
        (torch.bfloat16, torch.bfloat16, 128, 8, 64, 32),
        ("int4-g16", torch.float32, 6, 2, 64, 48),
        ("int8-channel", torch.bfloat16, 5, 2, 32, 40),
        ("fp8-channel", torch.float32, 4, 2, 32, 48),
    ],
)
def test_down_by_token_matches_reference(kind, dtype: torch.dtype, e: int, k: int, h: int, inter: int) -> None:
    """At M = 1 the down GEMM fused with the sum over k gives the reference, and, rounding once
    rather than per expert, no further from it than the grouped GEMM + sum_topk path."""
    gen = _gen("by-token", kind, dtype, e, k)
    w13, w2 = _experts(kind, e, h, inter, gen)
    weights, ids = _routing(1, e, k, gen)
    hidden = _randn(1, h, gen=gen, dtype=dtype)
    _check_fused(hidden, w13, w2, weights, ids, BY_TOKEN_TILES, TOL[dtype])
    ref = fused_moe_ref(hidden.double(), w13, w2, weights, ids)
    by_token, grouped = (
        fused_moe(hidden, w13, w2, weights, ids, config=c).double() for c in (BY_TOKEN_TILES, SMALL_TILES)
    )
    assert (by_token - ref).abs().max() <= (grouped - ref).abs().max() + TOL[dtype]["atol"] / 10


# (weight kind, activation dtype, M, E, k, H, I): top-k 1, 2 and 8 at M = 1..4 (at k = 8 of 128 most
# experts get nothing; at k = 2 of 4, blocks of several tokens), ragged H and I, each quantized form,
# and w13 and w2 quantized in different forms (as GGUF files mix them).
FUSED_CASES = [
    (torch.float32, torch.float32, 1, 8, 1, 64, 48),
    (torch.float32, torch.float32, 3, 4, 2, 40, 24),
    (torch.bfloat16, torch.bfloat16, 1, 128, 8, 64, 32),
    (torch.bfloat16, torch.bfloat16, 4, 128, 8, 48, 64),
    (torch.float16, torch.float16, 2, 6, 2, 32, 48),
    ("int8-channel", torch.bfloat16, 2, 5, 2, 64, 48),
    ("int4-g16", torch.float32, 4, 6, 2, 64, 48),
    ("int4-g32", torch.bfloat16, 1, 8, 2, 64, 64),
    ("fp8-channel", torch.float32, 3, 4, 2, 32, 48),
    (("int4-g16", "int8-channel"), torch.float32, 2, 5, 2, 64, 32),
]


@pytest.mark.parametrize(
    "kind,dtype,m,e,k,h,inter",
    FUSED_CASES,
    ids=[
        f"{c[0] if not isinstance(c[0], torch.dtype) else str(c[0])[6:]}-M{c[2]}-E{c[3]}-k{c[4]}" for c in FUSED_CASES
    ],
)
def test_fused_mlp_matches_float64_reference(kind, dtype: torch.dtype, m: int, e: int, k: int, h: int, inter: int):
    """The one-kernel MLP gives the float64 MoE; bit for bit again on a second call (the partials are
    summed in split order whoever sums them, and every counter is back at zero), and each token's
    row is what the token gets alone (nothing depends on its batch-mates)."""
    gen = _gen("fused-mlp", kind, dtype, m, e, k)
    if isinstance(kind, tuple):
        w13, w2 = _experts(kind[0], e, h, inter, gen)[0], _experts(kind[1], e, h, inter, gen)[1]
    else:
        w13, w2 = _experts(kind, e, h, inter, gen)
    weights, ids = _routing(m, e, k, gen)
    hidden = _randn(m, h, gen=gen, dtype=dtype)
    _check_fused(hidden, w13, w2, weights, ids, FUSED_TILES, TOL[dtype])
    out = fused_moe(hidden, w13, w2, weights, ids, config=FUSED_TILES)
    assert not tile_counters(hidden.device).any()
    assert torch.equal(fused_moe(hidden, w13, w2, weights, ids, config=FUSED_TILES), out)
    for t in range(m):
        alone = fused_moe(hidden[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1], config=FUSED_TILES)
        assert torch.equal(alone, out[t : t + 1])


def test_fused_mlp_is_chosen_where_the_table_says_up_to_a_few_tokens(monkeypatch) -> None:
    """Without a tuned `fused` entry no batch takes the one-kernel MLP (the two GEMMs are what was measured);
    with one, decode batches up to FUSED_MAX_TOKENS take it (its tiles fitted to the problem), larger ones
    the two GEMMs; fused_moe_from_logits follows the choice."""
    module = importlib.import_module("ember.kernels.fused_moe")  # ember.kernels.fused_moe is also the function
    cpu = torch.device("cpu")
    assert choose_moe_config(1, 8, 128, 2048, 768, "bfloat16", cpu).fused is None
    entry = {"block_m": 16, "gate_up": [64, 64, 4, 3], "down": [64, 64, 4, 3], "fused": [*default_fused_tiles(8, 768)]}
    keys = [problem_key(128, 2048, 768, kind) for kind in ("bfloat16", "int4-g32")] + [
        problem_key(8, 32, 48, "float32")
    ]
    table = {name: {key: {"1": entry} for key in keys} for name in {"cpu", device_key(torch.device(DEVICE))}}
    monkeypatch.setattr(importlib.import_module("ember.kernels.moe_config"), "load_table", lambda: table)
    grouped = choose_moe_config(1, 8, 128, 2048, 768, "int4-g32", cpu, (32, 32)).fused
    assert grouped is not None and grouped.block_i <= 32 and grouped.block_k <= 32  # inside w2's and w13's groups
    calls = []
    monkeypatch.setattr(module, "fused_mlp", lambda *args: calls.append(args[5]) or torch.zeros_like(args[0]))
    gen = _gen("fused-auto")
    w13, w2 = _experts(torch.float32, 8, 32, 48, gen)
    for m in range(1, FUSED_MAX_TOKENS + 2):
        assert (choose_moe_config(m, 8, 128, 2048, 768, "bfloat16", cpu).fused is not None) == (m <= FUSED_MAX_TOKENS)
        fused_moe_from_logits(_randn(m, 32, gen=gen), w13, w2, _randn(m, 8, gen=gen), 2, True)
        assert len(calls) == min(m, FUSED_MAX_TOKENS)
    assert calls[0] == choose_moe_config(1, 2, 8, 32, 48, "float32", cpu).fused


@pytest.mark.parametrize("kind,k", [(torch.float32, 1), ("int4-g16", 2)])
def test_fused_moe_all_tokens_to_one_expert(kind, k: int) -> None:
    """Every token's first choice is expert 2 (several full blocks of one expert; with k = 1 the only
    expert used, and no sum over k); no token picks expert 0."""
    gen = _gen("one-expert", kind)
    m, e, h, inter = 35, 4, 32, 32
    w13, w2 = _experts(kind, e, h, inter, gen)
    weights, _ = _routing(m, e, k, gen)
    ids = torch.tensor([[2, 3 if t % 2 else 1][:k] for t in range(m)], dtype=torch.int32, device=DEVICE)
    _check_fused(_randn(m, h, gen=gen), w13, w2, weights, ids, SMALL_TILES, TOL[torch.float32])


def test_tensor_parallel_slices_sum_to_the_whole() -> None:
    """Two ranks' slices of the intermediate dimension give partial sums that add up to the full MoE."""
    gen = _gen("tp")
    m, e, k, h, inter = 5, 4, 2, 32, 64
    w13, w2 = _experts("int4-g16", e, h, inter, gen)
    weights, ids = _routing(m, e, k, gen)
    x = _randn(m, h, gen=gen)
    half = inter // 2
    parts = []
    for rank in range(2):
        gate, up = w13.narrow(0, rank * half, half), w13.narrow(0, inter + rank * half, half)
        w13_rank = QuantizedExperts(
            gate.kind,
            torch.cat([gate.qweight, up.qweight], 1),
            torch.cat([gate.scales, up.scales], 1),
            torch.cat([gate.zeros, up.zeros], 1),
            gate.group_size,
            gate.in_features,
        )
        parts.append(fused_moe(x, w13_rank, w2.narrow(1, rank * half, half), weights, ids))
    torch.testing.assert_close(parts[0] + parts[1], fused_moe_ref(x, w13, w2, weights, ids), **TOL[torch.float32])


def test_fused_moe_rejects_mismatched_shapes() -> None:
    w13 = torch.zeros(4, 16, 32, device=DEVICE)
    weights, ids = _routing(2, 4, 2, _gen("bad"))
    with pytest.raises(ValueError, match="w13"):
        fused_moe(torch.zeros(2, 32, device=DEVICE), w13, torch.zeros(4, 32, 6, device=DEVICE), weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(torch.zeros(2, 32, device=DEVICE), w13, torch.zeros(4, 32, 8, device=DEVICE), weights, ids.long())


# --- configs -------------------------------------------------------------------------------------


def test_config_table_lookup_and_fallback() -> None:
    entry = MoeConfig(32, GemmTiles(128, 64, 8, 3), GemmTiles(64, 128, 4, 4))
    key = problem_key(128, 2048, 768, "bfloat16")
    table = {"GPU X": {key: {"16": default_moe_config(16, 128).to_json(), "64": entry.to_json()}}}
    assert lookup("GPU X", key, 17, table) == entry  # smallest tuned M at or above
    assert lookup("GPU X", key, 4096, table) == entry  # beyond the table: its largest M
    assert lookup("GPU X", problem_key(8, 4096, 14336, "bfloat16"), 1, table) is None
    assert lookup("GPU Y", key, 1, table) is None
    cfg = choose_moe_config(1, 8, 128, 2048, 768, "int4-g32", torch.device("cpu"), (32, 32))
    assert cfg.block_m == 16 and cfg.gate_up.block_k <= 32 and cfg.down.block_k <= 32  # K tiles inside a group
    by_token = entry._replace(down_by_token=GemmTiles(8, 256, 4, 4), fused=FusedTiles(32, 128, 256, 4, 3))
    assert MoeConfig.from_json(json.loads(json.dumps(by_token.to_json()))) == by_token
    assert entry.to_json().keys() == {"block_m", "gate_up", "down"}  # older tables read and write unchanged


def test_down_by_token_only_at_one_token(monkeypatch) -> None:
    """A tuned M = 1 entry with down_by_token also serves batches past the table's last M; only M = 1 takes it."""
    from ember.kernels import moe_config

    entry = MoeConfig(16, GemmTiles(64, 128, 4, 3), GemmTiles(64, 128, 4, 3), GemmTiles(8, 256, 4, 4))
    monkeypatch.setattr(moe_config, "lookup", lambda *args: entry)
    assert choose_moe_config(1, 8, 128, 2048, 768, "bfloat16", torch.device("cpu")).down_by_token == entry.down_by_token
    assert choose_moe_config(2, 8, 128, 2048, 768, "bfloat16", torch.device("cpu")).down_by_token is None


def test_weight_kind_names() -> None:
    gen = _gen("kind")
    assert weight_kind(torch.zeros(1, 2, 2, dtype=torch.bfloat16)) == "bfloat16"
    assert weight_kind(_experts("int4-g16", 2, 32, 16, gen)[0]) == "int4-g16"
    assert weight_kind(_experts("fp8-channel", 2, 32, 16, gen)[0]) == "fp8-channel"


def test_tuner_merges_into_the_table(tmp_path) -> None:
    """benchmarks/moe_tune.py adds its winners without dropping other GPUs' or problems' entries,
    and what it writes reads back through the runtime lookup."""
    from benchmarks.moe_tune import merge_table

    path = tmp_path / "table.json"
    old = default_moe_config(8, 8).to_json()
    path.write_text(json.dumps({"GPU A": {"E=8,H=64,I=32,bfloat16": {"1": old}}}))
    new = MoeConfig(32, GemmTiles(32, 128, 4, 4), GemmTiles(64, 64, 4, 3))
    merge_table(str(path), "GPU B", {"E=8,H=64,I=32,bfloat16": {"16": new.to_json()}})
    merge_table(str(path), "GPU A", {"E=8,H=64,I=32,bfloat16": {"256": new.to_json()}})
    table = json.loads(path.read_text())
    assert lookup("GPU A", "E=8,H=64,I=32,bfloat16", 1, table) == MoeConfig.from_json(old)
    assert lookup("GPU A", "E=8,H=64,I=32,bfloat16", 2, table) == new
    assert lookup("GPU B", "E=8,H=64,I=32,bfloat16", 1, table) == new
