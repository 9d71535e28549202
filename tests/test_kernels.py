"""Every Triton kernel in ember.kernels against its float32 PyTorch reference.

Without a GPU the kernels run in Triton's interpreter on tiny shapes; on a GPU the same tests
run compiled, and EMBER_KERNEL_TEST_FULL=1 switches to serving-sized shapes (B=64, contexts up to
4096, Hk=8, head_dim 128). fp8 caches are held to attention over their dequantized values, and the
PyTorch path of ember.model.attention to the kernels.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

# The interpreter is chosen when the kernels are decorated, so this must precede the import below.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ember.kernels import (
    apply_rotary,
    apply_rotary_ref,
    choose_num_splits,
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    rms_norm,
    rms_norm_ref,
    rotary_store,
    silu_and_mul,
    silu_and_mul_ref,
    store_kv,
    store_kv_ref,
)
from ember.kernels.attention_ref import attention_ref
from ember.ops import registry as backend
from ember.ops.attention import AttentionMetadata
from ember.ops.functional import paged_attention
from ember.ops.functional import store_kv as model_store_kv
from ember.quant.kv_scale import quantize_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FULL = os.environ.get("EMBER_KERNEL_TEST_FULL") == "1"
# Triton's interpreter truncates fp32 -> bf16 casts instead of rounding to nearest, so its bf16
# results can be a few units in the last place off; compiled kernels round exactly like PyTorch.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
NUM_KV_HEADS = 8 if FULL else 2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATTN_TOL = {
    torch.float32: dict(atol=2e-4, rtol=2e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
}
# A unit or two in the last place: elementwise kernels round where their references do.
ELEMENTWISE_TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2) if INTERPRETED else dict(atol=1e-2, rtol=1.6e-2),
}
# (block_size, GQA group, head_dim): every block size, group and head_dim appears at least once.
GEOMETRIES = [(8, 1, 64), (16, 2, 128), (32, 4, 32), (16, 8, 80), (128, 4, 64), (8, 3, 128)]
FP8 = torch.float8_e4m3fn
FP8_GEOMETRIES = [(16, 2, 128), (8, 3, 32)]
# Near amax / 448 for unit-normal data, as a per-layer scale would be, so the tails saturate; not
# powers of two, so scaling rounds.
FP8_SCALES = dict(k_scale=0.0123, v_scale=0.0091)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def paged_kv(
    seq_lens: list[int], block_size: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches holding each context in shuffled blocks, and block tables padded with block 0.

    Block 0, spare blocks and the slots past each context hold NaN, so a kernel that reads
    anything outside a sequence's context poisons its output.
    """
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks) + 3
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks + [1]) + 2, dtype=torch.int32)
    for b, (n, nblocks) in enumerate(zip(seq_lens, blocks)):
        own, ids = ids[:nblocks], ids[nblocks:]
        tables[b, :nblocks] = torch.tensor(own, dtype=torch.int32)
        slots = torch.tensor(own, dtype=torch.long)[:, None] * block_size + torch.arange(block_size)
        slots = slots.flatten()[:n]
        k_cache.view(-1, NUM_KV_HEADS, head_dim)[slots] = torch.randn(n, NUM_KV_HEADS, head_dim, generator=gen)
        v_cache.view(-1, NUM_KV_HEADS, head_dim)[slots] = torch.randn(n, NUM_KV_HEADS, head_dim, generator=gen)
    if dtype == FP8:
        # Quantized as store_kv stores them. NaN stays NaN on a GPU; the interpreter reads e4m3fn's
        # NaN as 480, still far enough off to show in the output.
        k_cache = quantize_kv(k_cache, FP8, FP8_SCALES["k_scale"])
        v_cache = quantize_kv(v_cache, FP8, FP8_SCALES["v_scale"])
    return k_cache.to(dtype=dtype, device=DEVICE), v_cache.to(dtype=dtype, device=DEVICE), tables.to(DEVICE)


def kv_scales(cache_dtype: torch.dtype) -> dict[str, float]:
    return FP8_SCALES if cache_dtype == FP8 else {}


def assert_same_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical, except bf16 under the interpreter (see INTERPRETED)."""
    if actual.dtype == torch.bfloat16 and INTERPRETED:
        torch.testing.assert_close(actual, expected, **ELEMENTWISE_TOL[torch.bfloat16])
    else:
        assert torch.equal(actual, expected)


def as_int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# ---------------------------------------------------------------- kv store


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_store_kv_writes_slots_and_skips_padding(dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_tokens, head_dim, num_blocks = (300, 128, 64) if FULL else (11, 80, 4)
    # k and v as strided views of a fused qkv projection output, as the engine produces them.
    qkv = randn(num_tokens, 3 * NUM_KV_HEADS * head_dim, gen=gen, dtype=dtype)
    k = qkv[:, NUM_KV_HEADS * head_dim : 2 * NUM_KV_HEADS * head_dim].view(num_tokens, NUM_KV_HEADS, head_dim)
    v = qkv[:, 2 * NUM_KV_HEADS * head_dim :].view(num_tokens, NUM_KV_HEADS, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    slots = slots.to(DEVICE)
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache, v_cache = randn(*shape, gen=gen, dtype=dtype), randn(*shape, gen=gen, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, k_ref, v_ref, slots)

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# ---------------------------------------------------------------- decode attention


def decode_seq_lens(gen: torch.Generator) -> list[int]:
    if FULL:
        return [1, 7, 17, 4096] + torch.randint(1, 4097, (60,), generator=gen).tolist()
    return [1, 7, 17, 130, 64]


def run_decode(
    block_size: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    num_splits: int | str,
    cache_dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output on q of `dtype` over caches of `cache_dtype`, and the float32 reference's
    over the values the caches stand for."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = decode_seq_lens(gen)
    k_cache, v_cache, tables = paged_kv(seq_lens, block_size, head_dim, cache_dtype, gen)
    q = randn(len(seq_lens), NUM_KV_HEADS * group, head_dim, gen=gen, dtype=dtype)
    lens = as_int32(seq_lens)
    scale = head_dim**-0.5
    # "auto" with a generous max_seq_len bound forces several splits even on tiny CPU shapes.
    splits = dict(num_splits=None, max_seq_len=1024) if num_splits == "auto" else dict(num_splits=num_splits)

    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, **splits, **kv_scales(cache_dtype))
    ref = paged_decode_attention_ref(q.float(), k_cache, v_cache, tables, lens, scale, **kv_scales(cache_dtype))
    assert out.dtype == dtype and out.shape == q.shape
    return out, ref


@pytest.mark.parametrize("num_splits", [1, 3, "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,group,head_dim", GEOMETRIES)
def test_decode_attention_matches_reference(
    block_size: int, group: int, head_dim: int, dtype: torch.dtype, num_splits: int | str
) -> None:
    out, ref = run_decode(
        block_size, group, head_dim, dtype, num_splits, dtype, seed=block_size * 100 + group * 10 + head_dim
    )
    torch.testing.assert_close(out.float(), ref, **ATTN_TOL[dtype])


def test_decode_attention_auto_splits_from_table_width_and_out_buffer() -> None:
    gen = torch.Generator().manual_seed(7)
    seq_lens = [3, 300, 0, 45]  # a zero-length row is a padded CUDA-graph slot: its output is zeros
    k_cache, v_cache, tables = paged_kv(seq_lens, 16, 64, torch.float32, gen)
    q = randn(len(seq_lens), NUM_KV_HEADS * 4, 64, gen=gen)
    out = torch.full_like(q, float("nan"))
    lens = as_int32(seq_lens)

    result = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, out=out)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)

    assert result is out
    torch.testing.assert_close(out, ref, **ATTN_TOL[torch.float32])
    assert torch.count_nonzero(out[2]) == 0


def test_choose_num_splits_fills_the_gpu_only_when_needed() -> None:
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=32768, num_sms=132) == 32
    assert choose_num_splits(batch=4, num_kv_heads=8, max_context=4096, num_sms=132) == 9
    assert choose_num_splits(batch=4, num_kv_heads=8, max_context=600, num_sms=132) == 3
    assert choose_num_splits(batch=64, num_kv_heads=8, max_context=4096, num_sms=132) == 1
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=200, num_sms=132) == 1


# ---------------------------------------------------------------- prefill attention


def prefill_chunks(gen: torch.Generator) -> list[tuple[int, int]]:
    """(cached prefix length, query length) per sequence: fresh prompts, chunks over long prefixes,
    one-token chunks, and a sequence with no queries this step."""
    chunks = [(0, 1), (0, 7), (9, 1), (30, 17), (0, 40), (100, 3), (15, 0), (70, 33)]
    if FULL:
        ctx = torch.randint(0, 3000, (24,), generator=gen).tolist()
        qlen = torch.randint(1, 513, (24,), generator=gen).tolist()
        chunks += [(0, 1024), (3000, 1)] + list(zip(ctx, qlen))
    return chunks


def run_prefill(
    chunks: list[tuple[int, int]],
    block_size: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    q_padding: int = 0,
    cache_dtype: torch.dtype | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    query_limits: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As run_decode, for prefill chunks; the caches are of q's dtype unless `cache_dtype` says."""
    seq_lens = [c + n for c, n in chunks]
    cache_dtype = cache_dtype or dtype
    k_cache, v_cache, tables = paged_kv(seq_lens, block_size, head_dim, cache_dtype, gen)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    num_heads = NUM_KV_HEADS * group
    # q_padding > 0 makes q a strided view of a wider (fused projection) buffer.
    q_buf = randn(starts[-1], num_heads * head_dim + q_padding, gen=gen, dtype=dtype)
    q = q_buf[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    lens, qsl = as_int32(seq_lens), as_int32(starts)
    max_q = max(n for _, n in chunks)
    scale = head_dim**-0.5

    masking = dict(
        causal=causal,
        sliding_window=sliding_window,
        query_limits=None if query_limits is None else as_int32(query_limits),
        **kv_scales(cache_dtype),
    )
    out = paged_prefill_attention(q, k_cache, v_cache, tables, lens, qsl, max_q, scale, **masking)
    ref = paged_prefill_attention_ref(q.float(), k_cache, v_cache, tables, lens, qsl, max_q, scale, **masking)
    return out, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,group,head_dim", GEOMETRIES)
def test_prefill_attention_matches_reference(block_size: int, group: int, head_dim: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(block_size * 100 + group * 10 + head_dim)
    out, ref = run_prefill(prefill_chunks(gen), block_size, group, head_dim, dtype, gen)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **ATTN_TOL[dtype])


@pytest.mark.parametrize(
    "chunks",
    [
        [(0, 1), (5, 1), (63, 1), (64, 1)],  # all one-token queries: the smallest row tiles
        [(0, 64), (0, 1)],  # query blocks ending exactly on a K/V tile
        [(127, 40), (0, 2)],  # long prefix whose end straddles a tile boundary
    ],
)
def test_prefill_attention_edge_chunks_and_strided_q(chunks: list[tuple[int, int]]) -> None:
    gen = torch.Generator().manual_seed(len(chunks))
    out, ref = run_prefill(chunks, 16, 4, 64, torch.float32, gen, q_padding=96)
    torch.testing.assert_close(out, ref, **ATTN_TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", [[1, 7, 64, 100], [130, 3]])
def test_bidirectional_prefill_sees_every_key_of_its_prompt(lens: list[int], dtype: torch.dtype) -> None:
    """An encoder's whole prompts (no cached context): each query attends to its sequence's every key,
    across K/V tile edges (64, 128) and with query blocks past the first."""
    gen = torch.Generator().manual_seed(sum(lens))
    out, ref = run_prefill([(0, n) for n in lens], 16, 2, 64, dtype, gen, causal=False)
    torch.testing.assert_close(out.float(), ref, **ATTN_TOL[dtype])
    causal, _ = run_prefill([(0, n) for n in lens], 16, 2, 64, dtype, torch.Generator().manual_seed(sum(lens)))
    assert not torch.allclose(causal.float(), ref, **ATTN_TOL[dtype])  # the flag changes what is seen


def test_attention_rejects_bad_shapes() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables = paged_kv([5], 16, 64, torch.float32, gen)
    q = randn(1, NUM_KV_HEADS + 1, 64, gen=gen)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(q, k_cache, v_cache, tables, as_int32([5]), 0.125)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_prefill_attention(
            randn(1, NUM_KV_HEADS, 64, gen=gen, dtype=torch.float16),
            k_cache,
            v_cache,
            tables,
            as_int32([5]),
            as_int32([0, 1]),
            1,
            0.125,
        )


# ---------------------------------------------------------------- query limits (Gemma 3's image tokens)

# (cached context, new tokens) per sequence, and the image blocks (first position, length) among them: at a
# chunk's start, middle and end; across the 64- and 128-token K/V tiles and query blocks; two in a sequence;
# after cached context; one the context (a prefix-cache hit) ends inside; and sequences without images.
IMAGE_CHUNKS = [(0, 20), (0, 40), (0, 30), (0, 150), (0, 60), (70, 33), (40, 20), (9, 1), (0, 7)]
IMAGE_BLOCKS = {
    0: [(0, 8)],
    1: [(10, 16)],
    2: [(22, 8)],
    3: [(56, 16), (120, 16)],
    4: [(5, 10), (30, 20)],
    5: [(80, 12)],
    6: [(35, 10)],
}


def image_limits(chunks: list[tuple[int, int]], blocks: dict[int, list[tuple[int, int]]]) -> list[int]:
    """The step's query limits: each token's own position, or its image block's last position."""
    limits: list[int] = []
    for b, (ctx, n) in enumerate(chunks):
        own = list(range(ctx, ctx + n))
        for first, length in blocks.get(b, []):
            for pos in range(max(first, ctx), first + length):
                own[pos - ctx] = first + length - 1
        limits += own
    return limits


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_query_limits_match_reference(group: int, dtype: torch.dtype, window: int | None) -> None:
    gen = torch.Generator().manual_seed(group)
    limits = image_limits(IMAGE_CHUNKS, IMAGE_BLOCKS)
    out, ref = run_prefill(IMAGE_CHUNKS, 16, group, 32, dtype, gen, sliding_window=window, query_limits=limits)
    torch.testing.assert_close(out.float(), ref, **ATTN_TOL[dtype])
    causal, _ = run_prefill(
        IMAGE_CHUNKS, 16, group, 32, dtype, torch.Generator().manual_seed(group), sliding_window=window
    )
    assert not torch.allclose(causal.float(), ref, **ATTN_TOL[dtype])  # the limits change what is seen


def test_prefill_query_limits_with_a_window_narrower_than_an_image() -> None:
    """The kernel keeps the reference's rule (the window counts from the query's own position) even where
    transformers 4 would differ: an image longer than the window, which Gemma 3 never has."""
    gen = torch.Generator().manual_seed(8)
    limits = image_limits(IMAGE_CHUNKS, IMAGE_BLOCKS)
    out, ref = run_prefill(IMAGE_CHUNKS, 16, 2, 32, torch.float32, gen, sliding_window=8, query_limits=limits)
    torch.testing.assert_close(out, ref, **ATTN_TOL[torch.float32])


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_limits_at_own_positions_are_exactly_causal(dtype: torch.dtype, window: int | None) -> None:
    chunks = IMAGE_CHUNKS[3:6]
    own = image_limits(chunks, {})
    limited, _ = run_prefill(
        chunks, 16, 4, 32, dtype, torch.Generator().manual_seed(1), sliding_window=window, query_limits=own
    )
    causal, _ = run_prefill(chunks, 16, 4, 32, dtype, torch.Generator().manual_seed(1), sliding_window=window)
    assert torch.equal(limited, causal)


def test_query_limits_are_checked() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables = paged_kv([5], 16, 64, torch.float32, gen)
    q = randn(2, NUM_KV_HEADS, 64, gen=gen)
    args = (q, k_cache, v_cache, tables, as_int32([5]), as_int32([0, 2]), 2, 0.125)
    with pytest.raises(ValueError, match="int32 tensor \\[2\\]"):
        paged_prefill_attention(*args, query_limits=as_int32([3, 4, 4]))
    with pytest.raises(ValueError, match="bidirectional"):
        paged_prefill_attention(*args, causal=False, query_limits=as_int32([4, 4]))
    with pytest.raises(ValueError, match="must lie in"):  # past the sequence: the chunk must hold the whole image
        paged_prefill_attention_ref(*args, query_limits=as_int32([5, 5]))
    with pytest.raises(ValueError, match="must lie in"):  # before the query's own position
        paged_prefill_attention_ref(*args, query_limits=as_int32([3, 3]))


@pytest.mark.parametrize("window", [None, 8, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_model_attention_query_limits_match_reference(
    path: str, dtype: torch.dtype, window: int | None, monkeypatch
) -> None:
    """A step as the engine lays it out (two decodes, then chunks with images) through paged_attention: on
    CPU tensors the PyTorch path, else the kernels; the decode rows' limits are their own positions."""
    device = "cpu" if path == "torch" else DEVICE
    monkeypatch.setattr(backend, "FORCE_TRITON", path == "triton")
    chunks = [(4, 1), (39, 1)] + IMAGE_CHUNKS
    blocks = {b + 2: images for b, images in IMAGE_BLOCKS.items()}
    seq_lens = [c + n for c, n in chunks]
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, tables = (t.to(device) for t in paged_kv(seq_lens, 16, 32, dtype, gen))
    if path == "torch":  # its decode gathers whole blocks, masked in SDPA: slots past a context must be finite
        k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = randn(starts[-1], NUM_KV_HEADS * 2, 32, gen=gen, dtype=dtype).to(device)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long, device=device),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        num_decodes=2,
        max_query_len=max(n for _, n in chunks[2:]),
        max_seq_len=max(seq_lens),
        seq_lens_host=seq_lens,
        query_start_host=starts,
        query_limits=torch.tensor(image_limits(chunks, blocks), dtype=torch.int32, device=device),
    )

    out = paged_attention(q, k_cache, v_cache, meta, 32**-0.5, sliding_window=window)

    ref = paged_prefill_attention_ref(
        q.float(),
        k_cache,
        v_cache,
        tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        32**-0.5,
        sliding_window=window,
        query_limits=meta.query_limits,
    )
    torch.testing.assert_close(out.float(), ref, **ATTN_TOL[dtype])


def visibility(seq_len: int, context_len: int, window: int | None, limits: list[int]) -> torch.Tensor:
    """Which keys attention_ref lets each query at context_len.. see ([Q, S] bool): with zero scores the
    softmax is uniform over them, and one-hot values read that distribution out."""
    q_len = seq_len - context_len
    out = attention_ref(
        torch.zeros(q_len, 1, seq_len),
        torch.zeros(seq_len, 1, seq_len),
        torch.eye(seq_len)[:, None],
        1.0,
        context_len,
        sliding_window=window,
        query_limits=torch.tensor(limits[context_len:]),
    )
    return out[:, 0] > 0


@pytest.mark.parametrize("window", [None, 6, 16])
def test_query_limits_see_what_transformers_gemma3_masks_show(window: int | None) -> None:
    """Transformers' own masks for Gemma 3 (OR(causal, same image block); sliding layers AND the window in,
    `create_masks_for_vision_model`) against the reference's rule, for a whole prompt and for the chunk
    after a prefix that ends inside the first image."""
    gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    if not hasattr(gemma3, "create_masks_for_vision_model"):
        pytest.skip("transformers before 5 builds Gemma 3's masks otherwise")
    from transformers import Gemma3TextConfig

    seq_len, blocks = 24, [(3, 5), (12, 5)]  # images shorter than the window, as Gemma 3's are
    config = Gemma3TextConfig(sliding_window=window or seq_len, head_dim=8, hidden_size=8, num_attention_heads=1)
    config._attn_implementation = "sdpa"
    token_types = torch.zeros(1, seq_len, dtype=torch.long)
    for first, length in blocks:
        token_types[0, first : first + length] = 1
    masks = gemma3.create_masks_for_vision_model(
        config,
        torch.zeros(1, seq_len, 8),
        None,
        None,
        torch.arange(seq_len)[None],
        gemma3.get_block_sequence_ids_for_mask(token_types),
    )
    expected = masks["full_attention" if window is None else "sliding_attention"][0, 0]
    limits = image_limits([(0, seq_len)], {0: blocks})
    for context_len in (0, 5):
        assert torch.equal(visibility(seq_len, context_len, window, limits), expected[context_len:])


# ---------------------------------------------------------------- fp8 KV cache


def fp8_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bitwise, so NaN and -0.0 count too."""
    return torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_fp8_rounds_like_reference_and_saturates(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    num_tokens, head_dim, block_size, num_blocks = 11, 80, 16, 4
    qkv = randn(num_tokens, 3 * NUM_KV_HEADS * head_dim, gen=gen, dtype=dtype) * 3
    k = qkv[:, NUM_KV_HEADS * head_dim : 2 * NUM_KV_HEADS * head_dim].view(num_tokens, NUM_KV_HEADS, head_dim)
    v = qkv[:, 2 * NUM_KV_HEADS * head_dim :].view(num_tokens, NUM_KV_HEADS, head_dim)
    # Past 448 * scale (saturate, never NaN), signed zero, and values that round into subnormals or to 0.
    extremes = torch.tensor([1e4, -1e4, float("inf"), float("-inf"), -0.0, 1e-6, -1e-6, 3e-5, -7e-5])
    k[1, 0, : extremes.numel()] = extremes.to(dtype=dtype, device=DEVICE)
    v[2, 1, : extremes.numel()] = extremes.to(dtype=dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    slots = slots.to(DEVICE)
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache = quantize_kv(randn(*shape, gen=gen), FP8, FP8_SCALES["k_scale"])
    v_cache = quantize_kv(randn(*shape, gen=gen), FP8, FP8_SCALES["v_scale"])
    k_ref, v_ref, k_torch, v_torch = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()

    store_kv(k, v, k_cache, v_cache, slots, **FP8_SCALES)
    store_kv_ref(k, v, k_ref, v_ref, slots, **FP8_SCALES)
    keep = slots >= 0  # ember.model.attention's PyTorch path is never given padding slots
    model_store_kv(k[keep], v[keep], k_torch, v_torch, slots[keep], **FP8_SCALES)

    assert fp8_bits_equal(k_cache, k_ref) and fp8_bits_equal(v_cache, v_ref)
    assert fp8_bits_equal(k_torch, k_ref) and fp8_bits_equal(v_torch, v_ref)
    assert not (k_cache.float().isnan().any() or v_cache.float().isnan().any())
    saturated = torch.tensor([448.0, -448.0, 448.0, -448.0], device=DEVICE)
    assert torch.equal(k_cache.view(-1, NUM_KV_HEADS, head_dim)[slots[1], 0, :4].float(), saturated)
    assert torch.equal(v_cache.view(-1, NUM_KV_HEADS, head_dim)[slots[2], 1, :4].float(), saturated)


@pytest.mark.parametrize("num_splits", [1, "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,group,head_dim", FP8_GEOMETRIES)
def test_decode_attention_fp8_cache_matches_dequantized_reference(
    block_size: int, group: int, head_dim: int, dtype: torch.dtype, num_splits: int | str
) -> None:
    out, ref = run_decode(block_size, group, head_dim, dtype, num_splits, FP8, seed=head_dim + group)
    torch.testing.assert_close(out.float(), ref, **ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,group,head_dim", FP8_GEOMETRIES)
def test_prefill_attention_fp8_cache_matches_dequantized_reference(
    block_size: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(head_dim + group)
    out, ref = run_prefill(prefill_chunks(gen), block_size, group, head_dim, dtype, gen, cache_dtype=FP8)
    torch.testing.assert_close(out.float(), ref, **ATTN_TOL[dtype])


def test_fp8_cache_attention_stays_close_to_bf16_cache() -> None:
    """The cost of quantizing: e4m3 keeps 3 mantissa bits (a relative error of up to 1/16 per value),
    which attention's averaging shrinks."""
    outs = [
        run_decode(16, 2, 128, torch.bfloat16, "auto", cache_dtype, seed=5)[0].float()
        for cache_dtype in (torch.bfloat16, FP8)
    ]
    assert torch.linalg.norm(outs[1] - outs[0]) <= 0.05 * torch.linalg.norm(outs[0])  # measured: 0.028


def fp8_attention_batch(
    dtype: torch.dtype, block_size: int, group: int, head_dim: int, gen: torch.Generator
) -> tuple[AttentionMetadata, dict[str, torch.Tensor]]:
    """Two decodes, then a fresh prompt and a chunk over a cached prefix, as the engine lays out a
    step, over fp8 caches whose cached context is random and whose new slots are still to be written."""
    chunks = [(4, 1), (39, 1), (0, 9), (20, 12)]  # (cached context, new tokens)
    seq_lens = [c + n for c, n in chunks]
    blocks = [-(-n // block_size) for n in seq_lens]
    ids = (torch.randperm(sum(blocks) + 2, generator=gen) + 1).tolist()  # block 0 stays unused padding
    tables = torch.zeros(len(chunks), max(blocks) + 1, dtype=torch.int32)
    slots = []
    for b, ((ctx, n), nblocks) in enumerate(zip(chunks, blocks)):
        tables[b, :nblocks] = torch.tensor(ids[:nblocks])
        ids = ids[nblocks:]
        pos = torch.arange(ctx, ctx + n)
        slots.append(tables[b, pos // block_size].long() * block_size + pos % block_size)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        num_decodes=2,
        max_query_len=max(n for _, n in chunks[2:]),
        max_seq_len=max(seq_lens),
        seq_lens_host=seq_lens,
        query_start_host=starts,
    )
    shape = (1 + sum(blocks) + 2, block_size, NUM_KV_HEADS, head_dim)
    new = starts[-1]
    tensors = dict(
        k_cache=quantize_kv(torch.randn(shape, generator=gen), FP8, FP8_SCALES["k_scale"]),
        v_cache=quantize_kv(torch.randn(shape, generator=gen), FP8, FP8_SCALES["v_scale"]),
        q=torch.randn(new, NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype),
        k=torch.randn(new, NUM_KV_HEADS, head_dim, generator=gen).to(dtype),
        v=torch.randn(new, NUM_KV_HEADS, head_dim, generator=gen).to(dtype),
    )
    return meta, tensors


def store_and_attend(
    meta: AttentionMetadata, cpu: dict[str, torch.Tensor], device: str, scales: dict
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step through ember.model.attention on `device` (PyTorch ops on CPU tensors, the kernels on
    CUDA or when forced): store the new k/v into copies of the caches, attend; returns (out, k_cache,
    v_cache) on CPU. Each call writes its own caches."""
    t = {name: x.to(device, copy=True) for name, x in cpu.items()}
    m = AttentionMetadata(**{f: x.to(device) if isinstance(x, torch.Tensor) else x for f, x in vars(meta).items()})
    s = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in scales.items()}
    model_store_kv(t["k"], t["v"], t["k_cache"], t["v_cache"], m.slot_mapping, **s)
    out = paged_attention(t["q"], t["k_cache"], t["v_cache"], m, t["q"].shape[-1] ** -0.5, **s)
    return out.cpu(), t["k_cache"].cpu(), t["v_cache"].cpu()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_model_attention_torch_path_on_fp8_cache_matches_kernels(dtype: torch.dtype, monkeypatch) -> None:
    """ember.model.attention on CPU tensors (PyTorch ops) against the same step through the kernels
    (on the GPU, or forced through the interpreter): the same cache bits, the same attention."""
    head_dim = 64
    meta, cpu = fp8_attention_batch(dtype, 16, 2, head_dim, torch.Generator().manual_seed(3))

    torch_out, torch_k, torch_v = store_and_attend(meta, cpu, "cpu", FP8_SCALES)
    monkeypatch.setattr(backend, "FORCE_TRITON", True)
    kernel_out, kernel_k, kernel_v = store_and_attend(meta, cpu, DEVICE, FP8_SCALES)

    assert fp8_bits_equal(torch_k, kernel_k) and fp8_bits_equal(torch_v, kernel_v)
    assert not fp8_bits_equal(torch_k, cpu["k_cache"])  # the new tokens did land
    torch.testing.assert_close(torch_out.float(), kernel_out.float(), **ATTN_TOL[dtype])


def test_kv_scales_are_host_floats_for_fp8_caches_only() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables = paged_kv([5], 16, 64, torch.float32, gen)
    k8, v8, _ = paged_kv([5], 16, 64, FP8, torch.Generator().manual_seed(0))
    q = randn(1, NUM_KV_HEADS, 64, gen=gen, dtype=torch.bfloat16)
    lens = as_int32([5])
    with pytest.raises(ValueError, match="only to fp8 caches"):
        paged_decode_attention(q.float(), k_cache, v_cache, tables, lens, 0.125, k_scale=0.5)
    with pytest.raises(ValueError, match="only to fp8 caches"):
        store_kv(q.float(), q.float(), k_cache, v_cache, as_int32([0]), v_scale=2.0)
    with pytest.raises(TypeError, match="Python floats"):
        paged_decode_attention(q, k8, v8, tables, lens, 0.125, k_scale=torch.tensor(0.5, device=DEVICE))
    with pytest.raises(ValueError, match="share a dtype"):
        paged_prefill_attention(q, k8, v_cache, tables, lens, as_int32([0, 1]), 1, 0.125)


# ---------------------------------------------------------------- rms norm

HIDDEN_SIZES = [576, 1024, 4096]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_rms_norm_matches_reference(hidden: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(hidden)
    rows = 256 if FULL else 5
    x = randn(rows, hidden, gen=gen, dtype=dtype) * 3
    weight = (1 + 0.1 * randn(hidden, gen=gen)).to(dtype)

    y = rms_norm(x, weight, 1e-6)

    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.float(), rms_norm_ref(x, weight, 1e-6).float(), **ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_fused_add_rms_norm_matches_reference(hidden: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(hidden + 1)
    rows = 256 if FULL else 5
    x, residual = randn(rows, hidden, gen=gen, dtype=dtype), randn(rows, hidden, gen=gen, dtype=dtype)
    weight = (1 + 0.1 * randn(hidden, gen=gen)).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()

    y, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    y_ref, new_residual_ref = fused_add_rms_norm_ref(x, residual, weight, 1e-5)

    assert_same_rounding(new_residual, new_residual_ref)  # one rounding of the same sum
    torch.testing.assert_close(y.float(), y_ref.float(), **ELEMENTWISE_TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_strided_view(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    tokens, heads, head_dim = (128, 32, 128) if FULL else (6, 4, 80)
    qkv = randn(tokens, (heads + 2) * head_dim, gen=gen, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # row stride != heads * head_dim
    weight = (1 + 0.1 * randn(head_dim, gen=gen)).to(dtype)

    y = rms_norm(q, weight, 1e-6)

    assert y.shape == q.shape
    torch.testing.assert_close(y.float(), rms_norm_ref(q, weight, 1e-6).float(), **ELEMENTWISE_TOL[dtype])


# ---------------------------------------------------------------- rotary


def rotary_tables(head_dim: int, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,group", [(64, 4), (128, 1), (80, 2), (32, 8)])
def test_rotary_matches_hf_formula(head_dim: int, group: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(head_dim + group)
    tokens, max_pos = (512, 8192) if FULL else (9, 4096)
    num_heads = NUM_KV_HEADS * group
    cos, sin = rotary_tables(head_dim, max_pos)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(DEVICE)
    qkv = randn(tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim, gen=gen, dtype=dtype)
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + NUM_KV_HEADS) * head_dim].view(tokens, NUM_KV_HEADS, head_dim)
    qkv_before = qkv.clone()

    q_rot, k_rot = apply_rotary(positions, q, k, cos, sin)
    q_ref, k_ref = apply_rotary_ref(positions, q, k, cos, sin)

    assert torch.equal(qkv, qkv_before)
    assert_same_rounding(q_rot, q_ref)  # every product and sum rounded where HF rounds it
    assert_same_rounding(k_rot, k_ref)


def test_mrope_rotary_matches_hf_sections() -> None:
    """M-RoPE ([3, T] positions, Qwen2.5-VL): the Triton kernel (reading each token's own table row) and the
    PyTorch path rotate as transformers' Qwen2_5_VLRotaryEmbedding + apply_rotary_pos_emb do."""
    from ember.model.layers import RotaryEmbedding
    from ember.ops import rotary

    gen = torch.Generator().manual_seed(3)
    head_dim, section, tokens = 16, (2, 3, 3), 9
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None, None, section).to(DEVICE)
    positions = torch.randint(0, 64, (3, tokens), generator=gen).to(DEVICE)
    q, k = randn(tokens, 4, head_dim, gen=gen), randn(tokens, 2, head_dim, gen=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = positions.cpu()[..., None].float() * inv_freq  # [3, T, D / 2]
    angles = torch.cat([m[i % 3] for i, m in enumerate(freqs.split(list(section), dim=-1))], dim=-1)
    angles = torch.cat((angles, angles), dim=-1).to(DEVICE)
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., head_dim // 2 :], x[..., : head_dim // 2]), dim=-1)

    expected = (q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)
    for impl in (rotary.TritonRotary(), rotary.TorchFullRotary(), rotary.TorchRotary()):
        for got, want in zip(impl(rope, positions, q, k), expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert rope.full_tables(head_dim) is None  # the fused rotary-and-store kernels read one position a token


def unfused_rotary_store(positions, qkv, cos, sin, k_cache, v_cache, slots, num_heads, qk_norm):
    """What a layer computes without the fused kernel: the per-head norms, rotary, then the store."""
    head_dim = k_cache.shape[-1]
    qk = qkv.view(qkv.shape[0], -1, head_dim)
    q, k, v = qk[:, :num_heads], qk[:, num_heads:-NUM_KV_HEADS], qk[:, -NUM_KV_HEADS:]
    if qk_norm is not None:
        q, k = rms_norm(q, qk_norm[0], qk_norm[2]), rms_norm(k, qk_norm[1], qk_norm[2])
    q, k = apply_rotary(positions, q, k, cos, sin)
    store_kv(k, v, k_cache, v_cache, slots)
    return q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,group,norm", [(64, 4, False), (128, 2, True), (80, 3, True), (32, 1, False)])
def test_rotary_store_matches_rotary_then_store(head_dim: int, group: int, norm: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(head_dim * group)
    tokens, block_size, num_blocks, max_pos = (300, 16, 64, 8192) if FULL else (7, 8, 4, 512)
    num_heads = NUM_KV_HEADS * group
    cos, sin = rotary_tables(head_dim, max_pos)
    sin_signed = torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), dim=-1)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(DEVICE)
    qkv = randn(tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim, gen=gen, dtype=dtype) * 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::3] = -1
    slots = slots.to(DEVICE)
    weights = (randn(head_dim, gen=gen, dtype=dtype), randn(head_dim, gen=gen, dtype=dtype), 1e-6)
    qk_norm = weights if norm else None
    k_cache = randn(num_blocks, block_size, NUM_KV_HEADS, head_dim, gen=gen, dtype=dtype)
    v_cache = randn(num_blocks, block_size, NUM_KV_HEADS, head_dim, gen=gen, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    q = rotary_store(positions, qkv, cos, sin_signed, k_cache, v_cache, slots, num_heads, qk_norm)
    q_ref = unfused_rotary_store(positions, qkv, cos, sin, k_ref, v_ref, slots, num_heads, qk_norm)

    assert torch.equal(v_cache, v_ref)  # values copied, padding rows (slot -1) untouched
    if norm:  # the sum of squares reduced in another order: equal up to a rounding of the norm
        torch.testing.assert_close(q, q_ref, **ELEMENTWISE_TOL[dtype])
        torch.testing.assert_close(k_cache, k_ref, **ELEMENTWISE_TOL[dtype])
    else:
        assert torch.equal(q, q_ref) and torch.equal(k_cache, k_ref)


def test_rotary_store_rejects_fp8_caches_and_bad_widths() -> None:
    gen = torch.Generator().manual_seed(0)
    cos, sin = rotary_tables(32, 16)
    cache = randn(2, 8, NUM_KV_HEADS, 32, gen=gen)
    qkv = randn(3, (4 + 2 * NUM_KV_HEADS) * 32, gen=gen)
    slots, positions = as_int32([0, 1, 2]), as_int32([0, 1, 2])
    with pytest.raises(ValueError, match="must hold 5 query"):
        rotary_store(positions, qkv, cos, sin, cache, cache.clone(), slots, 5)
    with pytest.raises(ValueError, match="fp8 caches store unfused"):
        rotary_store(positions, qkv, cos, sin, cache.to(FP8), cache.to(FP8), slots, 4)


# ---------------------------------------------------------------- activation


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [128, 1000, 2500])
def test_silu_and_mul_matches_reference(inter: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(inter)
    tokens = 300 if FULL else 4
    x = randn(tokens, 2 * inter, gen=gen, dtype=dtype) * 4

    y = silu_and_mul(x)

    assert y.shape == (tokens, inter) and y.dtype == dtype
    torch.testing.assert_close(y.float(), silu_and_mul_ref(x).float(), **ELEMENTWISE_TOL[dtype])
