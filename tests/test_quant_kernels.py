"""quant_matmul, the packed kernel and the dequantize kernels against float64 products of the
dequantized weight (and GGUF's 4-bit blocks against gguf-py's decoding).

Without a GPU the kernels run in Triton's interpreter on tiny, deliberately ragged shapes (odd K,
partial groups and tiles); on a GPU the same tests run compiled, and EMBER_KERNEL_TEST_FULL=1
switches to serving-sized shapes (M in {1, 16, 256}, N = K = 4096, group 128).
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import zlib

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

# The interpreter is chosen when the kernels are decorated, so this must precede the import below.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ember.kernels import (
    QuantMatmulConfig,
    choose_quant_matmul_config,
    dequantize_kernel,
    quant_matmul,
    quant_matmul_ref,
)
from ember.kernels.quant_packed import (
    _INT4_PAIRS,
    PackedConfig,
    choose_packed_config,
    dequantize_packed,
    pack_weight,
    packable,
    packed_matmul,
)
from ember.model.gguf_blocks import quantized as gguf_quantized
from ember.ops.linear_gpu import PACKED_MAX_ROWS, gpu_matmul
from ember.quant.formats import QuantizedWeight, codes, dequantize, pack_int4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FULL = os.environ.get("EMBER_KERNEL_TEST_FULL") == "1"
# Triton's interpreter truncates fp32 -> bf16 casts instead of rounding to nearest.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PER_CHANNEL = 0  # stands for group_size = K
# Outputs are O(1); bf16/fp16 round the dequantized weight and the output once each.
MATMUL_TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2} if INTERPRETED else {"atol": 2e-2, "rtol": 2e-2},
}


def _case(
    kind: str, group: int, zeros: bool, dtype: torch.dtype, shape: tuple[int, int, int], bias: bool
) -> pytest.ParameterSet:
    name = f"{kind}-g{group or 'K'}-{'zeros' if zeros else 'sym'}-{str(dtype)[6:]}-{'x'.join(map(str, shape))}"
    return pytest.param(kind, group, zeros, dtype, shape, bias, id=name + ("-bias" if bias else ""))


def _cases() -> list[pytest.ParameterSet]:
    """Off FULL, every kind/group/zeros/dtype mix runs on one shape, rotating through shapes with a
    period (5) coprime to the others, so each dtype and group meets every shape without running the
    whole product."""
    if FULL:
        return [
            _case(kind, 128, zeros, dtype, (m, 4096, 4096), True)
            for kind, zeros, dtype, m in itertools.product(["int8", "int4"], [False, True], DTYPES, [1, 16, 256])
        ]
    shapes = [(1, 17, 129), (3, 64, 40), (33, 17, 256), (1, 64, 256), (3, 17, 129)]
    mixes = itertools.product(["int8", "int4"], [16, 32, 128, PER_CHANNEL], [False, True], DTYPES)
    return [_case(*mix, shapes[i % len(shapes)], i % 2 == 0) for i, mix in enumerate(mixes)]


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def make_weight(kind: str, n: int, k: int, group_size: int, with_zeros: bool, gen: torch.Generator) -> QuantizedWeight:
    """Random codes over the kind's whole range, scaled so x @ w.T is O(1) for x ~ N(0, 1).

    Scales and zeros are views into tensors one group wider whose spare column is NaN, and an odd
    K's int4 padding nibble is 15, so reading past the weight's groups or K shows in the result.
    """
    num_groups = -(-k // group_size)
    if kind == "int8":
        qweight, levels = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), 128
    else:
        qweight, levels = pack_int4(torch.randint(0, 16, (n, k), generator=gen)), 8
        if k % 2:
            qweight[:, -1] |= 0xF0
    scales = torch.full((n, num_groups + 1), float("nan"))
    scales[:, :num_groups] = (0.5 + torch.rand(n, num_groups, generator=gen)) / (levels * k**0.5)
    zeros = None
    if with_zeros:
        zeros = torch.full((n, num_groups + 1), float("nan"))
        zeros[:, :num_groups] = torch.randn(n, num_groups, generator=gen) * levels * scales[:, :num_groups]
        zeros = zeros[:, :num_groups]
    return QuantizedWeight(kind, qweight, scales[:, :num_groups], zeros, group_size, k).to(DEVICE)


def make_input(m: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """x [M, K] as a view of a wider NaN-padded buffer: a kernel that reads past K poisons its output."""
    x = torch.full((m, k + 5), float("nan"))
    x[:, :k] = torch.randn(m, k, generator=gen)
    return x.to(dtype=dtype, device=DEVICE)[:, :k]


def expected_f64(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ bias) in float64, dequantizing independently of formats.dequantize."""
    group_idx = torch.arange(w.in_features, device=x.device) // w.group_size
    dense = codes(w).double() * w.scales.double()[:, group_idx]
    if w.zeros is not None:
        dense += w.zeros.double()[:, group_idx]
    out = x.double() @ dense.T
    return out if bias is None else out + bias.double()


def check_matmul(
    x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None, config: QuantMatmulConfig | None = None
) -> None:
    out = quant_matmul(x, w, bias, config=config)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], w.out_features)
    expected = expected_f64(x, w, bias)
    torch.testing.assert_close(out.double(), expected, **MATMUL_TOL[x.dtype])
    torch.testing.assert_close(quant_matmul_ref(x, w, bias).double(), expected, **MATMUL_TOL[x.dtype])


@pytest.mark.parametrize("kind,group,zeros,dtype,shape,with_bias", _cases())
def test_quant_matmul_matches_float64(
    kind: str, group: int, zeros: bool, dtype: torch.dtype, shape: tuple[int, int, int], with_bias: bool
) -> None:
    m, n, k = shape
    gen = _gen(kind, group, zeros, dtype, shape)
    w = make_weight(kind, n, k, group or k, zeros, gen)
    bias = torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE) if with_bias else None
    check_matmul(make_input(m, k, dtype, gen), w, bias)


# (M, N, K, group, config): split-K with a short last split, several M tiles, per-element scales
# (BLOCK_K spanning groups, a group that is no power of two), several K tiles per group, and the
# large-M tiles of the heuristic.
TILINGS = [
    (33, 17, 259, 16, QuantMatmulConfig(16, 16, 64, 3, 4, 1)),
    (5, 64, 200, 48, None),
    (5, 64, 200, 64, QuantMatmulConfig(16, 32, 32, 2, 4, 1)),
    (1, 17, 129, 129, QuantMatmulConfig(16, 16, 16, 16, 4, 1)),
    (1100, 40, 72, 32, None),
]


@pytest.mark.skipif(FULL, reason="tiny ragged shapes: the FULL run covers serving sizes")
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("m,n,k,group,config", TILINGS)
def test_quant_matmul_tilings(kind: str, m: int, n: int, k: int, group: int, config: QuantMatmulConfig | None) -> None:
    gen = _gen(kind, m, n, k, group)
    check_matmul(
        make_input(m, k, torch.float32, gen), make_weight(kind, n, k, group, kind == "int4", gen), None, config
    )


def test_config_fills_the_gpu_for_decode() -> None:
    """Decode tiles are 16 rows, split-K brings even N = 1024 to at least one program per SM, and
    every K tile of a power-of-two group lies inside one group."""
    for n, k in [(1024, 4096), (1024, 14336), (4096, 14336), (14336, 4096)]:
        cfg = choose_quant_matmul_config(1, n, k, 128, num_sms=132)
        assert cfg.block_m == 16 and 128 % cfg.block_k == 0
        assert -(-n // cfg.block_n) * cfg.split_k >= 132
    large = choose_quant_matmul_config(4096, 4096, 4096, 128, num_sms=132)
    assert large.block_m >= 64 and large.split_k == 1
    assert choose_quant_matmul_config(1, 4096, 4096, 16, num_sms=132).block_k == 16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,zeros", [("int8", False), ("int8", True), ("int4", False), ("int4", True)])
def test_dequantize_kernel_matches_formats(kind: str, zeros: bool, dtype: torch.dtype) -> None:
    """Bit-identical to formats.dequantize, except bf16 under the interpreter (see INTERPRETED)."""
    n, k, group = (4096, 4096, 128) if FULL else (19, 301, 32)
    w = make_weight(kind, n, k, group, zeros, _gen(kind, zeros, dtype))
    out = dequantize_kernel(w, dtype)
    expected = dequantize(w, dtype)
    if dtype == torch.bfloat16 and INTERPRETED:
        torch.testing.assert_close(out, expected, atol=0, rtol=2**-7)
    else:
        assert torch.equal(out, expected)


def test_fp8_weights_are_rejected() -> None:
    w = QuantizedWeight("fp8", torch.zeros(4, 16, dtype=torch.float8_e4m3fn), torch.ones(4, 1), None, 16, 16)
    with pytest.raises(ValueError, match="int8 or int4"):
        quant_matmul(torch.zeros(1, 16), w)


# The packed layout and kernel (ember/kernels/quant_packed.py). Each case is (kind, group, zeros,
# dtype, (M, N, K), config): M = 1, 3, 16 and 64, every group size the layout takes (16-multiples,
# one that does not divide the tile, per-channel), odd N and K, split-K on and off, every variant.
PACKED_CASES = [
    ("int4", 128, True, torch.bfloat16, (1, 48, 256), PackedConfig("fma", 1, 16, 1, 4, 1)),
    ("int4", 32, True, torch.float32, (1, 33, 300), PackedConfig("fma", 1, 32, 3, 4, 1)),
    ("int4", 64, False, torch.float16, (3, 17, 129), PackedConfig("fma", 1, 16, 2, 4, 1)),
    ("int4", PER_CHANNEL, False, torch.float32, (16, 20, 200), PackedConfig("dot", 16, 16, 2, 4, 1)),
    ("int4", 16, True, torch.bfloat16, (3, 24, 256), PackedConfig("dot", 16, 32, 1, 4, 1)),
    ("int4", 48, True, torch.float32, (64, 17, 130), PackedConfig("dot", 64, 16, 2, 4, 1)),
    ("int8", PER_CHANNEL, False, torch.bfloat16, (1, 40, 256), PackedConfig("fma", 1, 16, 4, 4, 1)),
    ("int8", 32, False, torch.float32, (3, 17, 129), PackedConfig("fma", 1, 16, 1, 4, 1)),
    ("int8", 128, True, torch.float16, (16, 33, 200), PackedConfig("dot", 16, 32, 3, 4, 1)),
    ("int8", 64, True, torch.float32, (64, 20, 130), PackedConfig("dot", 64, 16, 1, 4, 1)),
    ("int4", 128, True, torch.bfloat16, (1, 48, 256), PackedConfig("mma", 16, 16, 2, 4, 1)),
    ("int4", 32, False, torch.float32, (3, 33, 300), PackedConfig("mma", 16, 32, 3, 4, 1)),
    ("int4", PER_CHANNEL, True, torch.float16, (17, 20, 200), PackedConfig("mma", 16, 16, 1, 4, 1)),
    ("int4", 64, True, torch.float16, (4, 130, 256), PackedConfig("mma", 16, 64, 2, 4, 2)),
    ("int8", 64, True, torch.bfloat16, (2, 40, 256), PackedConfig("mma", 16, 64, 2, 4, 1)),
    ("int4", 32, True, torch.bfloat16, (1, 200, 512), PackedConfig("mma", 16, 128, 2, 4, 2)),
    ("int4", PER_CHANNEL, False, torch.bfloat16, (5, 300, 384), PackedConfig("mma", 16, 256, 3, 4, 2)),
    ("int8", 16, False, torch.float32, (1, 17, 72), None),
    ("int4", 128, True, torch.float32, (3, 40, 256), None),
]


def _packed_id(case: tuple) -> str:
    kind, group, zeros, dtype, shape, cfg = case
    variant = f"{cfg.variant}-split{cfg.split_k}" if cfg else "auto"
    return (
        f"{kind}-g{group or 'K'}-{'zeros' if zeros else 'sym'}-{str(dtype)[6:]}-{'x'.join(map(str, shape))}-{variant}"
    )


def _run_ptx(asm: str, a: int, b: int) -> list[int]:
    """The "mma" variant's int4 PTX on two 32-bit words, instruction by instruction: prmt.b32 (default
    mode), lop3.b32, shr.u32, as the PTX ISA defines them; returns $0..$7."""
    regs = {"$8": a, "$9": b}
    val = lambda x: regs[x] if x in regs else int(x, 0)  # noqa: E731
    for line in asm.split("\n"):
        op, _, rest = line.strip().rstrip(";").partition(" ")
        args = [x.strip() for x in rest.split(",")]
        if op == "prmt.b32":
            pool = val(args[1]) | val(args[2]) << 32
            sel = val(args[3])
            regs[args[0]] = sum(((pool >> 8 * (sel >> 4 * i & 7)) & 0xFF) << 8 * i for i in range(4))
        elif op == "lop3.b32":
            x, y, z, lut = (val(v) for v in args[1:])
            regs[args[0]] = sum(
                ((lut >> ((x >> i & 1) << 2 | (y >> i & 1) << 1 | (z >> i & 1))) & 1) << i for i in range(32)
            )
        elif op == "shr.u32":
            regs[args[0]] = val(args[1]) >> val(args[2])
        else:
            assert op in ("{", ".reg", "}"), op
    return [regs[f"${i}"] for i in range(8)]


@pytest.mark.parametrize("dtype", sorted(_INT4_PAIRS, key=str))
def test_int4_pairs_ptx_gives_offset_plus_code(dtype: torch.dtype) -> None:
    """The inline PTX runs only on a GPU; its logic is checked here. Output i of two words holds field i
    of the first word in its low half and of the second in its high half, each as the 16-bit float
    offset + u, exactly, for every code value in every field."""
    offset, asm = _INT4_PAIRS[dtype]
    rng = np.random.default_rng(7)
    words = [0, 0xFFFFFFFF, 0x76543210, 0x89ABCDEF, *map(int, rng.integers(0, 2**32, 12, dtype=np.uint64))]
    for a, b in zip(words, words[1:] + words[:1]):
        out = _run_ptx(asm, a, b)
        halves = torch.tensor([[o & 0xFFFF, o >> 16] for o in out], dtype=torch.int32).to(torch.int16)
        got = halves.view(dtype).float()
        fields = torch.tensor([[a >> 4 * i & 15, b >> 4 * i & 15] for i in range(8)], dtype=torch.float32)
        assert torch.equal(got, fields + offset), (hex(a), hex(b))


@pytest.mark.skipif(FULL, reason="tiny ragged shapes: the FULL run covers serving sizes")
@pytest.mark.parametrize("kind,group,zeros,dtype,shape,config", PACKED_CASES, ids=map(_packed_id, PACKED_CASES))
def test_packed_matmul_matches_float64(
    kind: str, group: int, zeros: bool, dtype: torch.dtype, shape: tuple[int, int, int], config: PackedConfig | None
) -> None:
    m, n, k = shape
    gen = _gen("packed", kind, group, zeros, shape)
    w = make_weight(kind, n, k, group or k, zeros, gen)
    x = make_input(m, k, dtype, gen)
    bias = torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE) if m == 3 else None
    out = packed_matmul(x, pack_weight(w), bias, config=config)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.double(), expected_f64(x, w, bias), **MATMUL_TOL[dtype])


@pytest.mark.parametrize(
    "kind,zeros,group,k",
    [("int4", True, 32, 301), ("int4", False, 128, 256), ("int8", False, PER_CHANNEL, 129), ("int8", True, 16, 200)],
)
def test_packed_layout_keeps_the_weight_exactly(kind: str, zeros: bool, group: int, k: int) -> None:
    """Packing is lossless: the packed codes dequantize to formats.dequantize bit for bit."""
    w = make_weight(kind, 37, k, group or k, zeros, _gen("layout", kind, zeros, group, k))
    packed = pack_weight(w)
    assert packed.qweight.dtype == torch.int32 and packed.qweight.shape[0] == 37
    assert packed.qweight.shape[1] * (32 // packed.bits) % packed.tile_k == 0
    assert torch.equal(dequantize_packed(packed), dequantize(w))


def _random_q4_k(rows: int, cols: int, gen: torch.Generator) -> np.ndarray:
    """Random Q4_K blocks (gguf-py has no Q4_K quantizer): random codes, sub-block scales and mins,
    with the two fp16 super-block factors set to finite values."""
    block_bytes, block_size = gguf.GGML_QUANT_SIZES[QType.Q4_K][1], gguf.GGML_QUANT_SIZES[QType.Q4_K][0]
    blocks = torch.randint(0, 256, (rows, cols // block_size, block_bytes), generator=gen, dtype=torch.uint8).numpy()
    factors = (0.5 + torch.rand(rows, cols // block_size, 2, generator=gen)).numpy() * np.array([0.01, 0.02])
    blocks[:, :, :4] = factors.astype(np.float16).view(np.uint8).reshape(rows, cols // block_size, 4)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1, QType.Q4_K])
def test_packed_matmul_reads_gguf_q4_forms(qtype: QType) -> None:
    """GGUF's 4-bit blocks arrive as int4 group 32 with zeros; the packed kernel multiplies by
    exactly what gguf-py decodes."""
    gen = _gen("gguf", qtype.name)
    rows, cols = 24, 512
    if qtype == QType.Q4_K:
        raw = _random_q4_k(rows, cols, gen)
    else:
        raw = gguf.quants.quantize(torch.randn(rows, cols, generator=gen).numpy(), qtype)
    w = gguf_quantized(raw, qtype, (rows, cols)).to(DEVICE)
    assert (w.kind, w.group_size, w.zeros is not None) == ("int4", 32, True)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(rows, cols)).double().to(DEVICE)
    x = make_input(2, cols, torch.float32, gen)
    out = packed_matmul(x, pack_weight(w), config=PackedConfig("fma", 1, 16, 4, 4, 1))
    torch.testing.assert_close(out.double(), x.double() @ reference.T, atol=1e-4, rtol=1e-4)


def test_packed_split_k_is_deterministic_and_leaves_counters_zero() -> None:
    """The last split of each tile sums the partials in split order and resets its counter, so a
    second call (a CUDA graph replay) gives the same bits; a counter left non-zero would make every
    split of the second call think another is last, and no output would be written."""
    gen = _gen("determinism")
    w = pack_weight(make_weight("int4", 40, 512, 64, True, gen))
    x = make_input(2, 512, torch.float32, gen)
    cfg = PackedConfig("fma", 1, 16, 4, 4, 1)
    first = packed_matmul(x, w, config=cfg)
    assert torch.equal(packed_matmul(x, w, config=cfg), first)


def test_packed_config_table_and_heuristic(tmp_path: pathlib.Path) -> None:
    """A table entry serves every M up to its own (the smallest tuned M at or above); shapes absent
    from the table get the heuristic: one-row FMA programs for decode, filling the SMs with split-K."""
    tuned = PackedConfig("dot", 16, 64, 2, 4, 3)
    table = tmp_path / "table.json"
    table.write_text(
        json.dumps(
            {
                "entries": [
                    {
                        "kind": "int4",
                        "n": 4096,
                        "k": 4096,
                        "m": 1,
                        "config": PackedConfig("fma", 1, 128, 8, 4, 2)._asdict(),
                    },
                    {"kind": "int4", "n": 4096, "k": 4096, "m": 16, "config": tuned._asdict()},
                ]
            }
        )
    )
    assert choose_packed_config(1, 4096, 4096, "int4", 132, str(table)).variant == "fma"
    assert choose_packed_config(4, 4096, 4096, "int4", 132, str(table)) == tuned
    assert choose_packed_config(64, 4096, 4096, "int4", 132, str(table)) == tuned
    for n, k in [(1024, 4096), (6144, 4096), (4096, 14336)]:
        cfg = choose_packed_config(1, n, k, "int8", 132, str(table))
        assert cfg.variant == "fma" and -(-n // cfg.block_n) * cfg.split_k >= 132
    assert choose_packed_config(16, 4096, 4096, "int8", 132, str(tmp_path / "missing.json")).variant == "dot"


def test_gpu_matmul_takes_the_packed_kernel_then_cublas() -> None:
    """QuantLinear's GPU dispatch: the packed layout up to PACKED_MAX_ROWS, its dequantized weight + cuBLAS above;
    a weight the layout does not take (groups of 8) keeps to quant_matmul."""
    gen = _gen("dispatch")
    w = make_weight("int4", 24, 256, 32, True, gen)
    for m in (2, PACKED_MAX_ROWS + 1):
        x = make_input(m, 256, torch.float32, gen)
        torch.testing.assert_close(
            gpu_matmul(x, w, pack_weight(w)).double(), expected_f64(x, w, None), **MATMUL_TOL[torch.float32]
        )
    odd = make_weight("int8", 24, 64, 8, False, gen)
    assert not packable(odd)
    x = make_input(1, 64, torch.float32, gen)
    torch.testing.assert_close(
        gpu_matmul(x, odd, None).double(), expected_f64(x, odd, None), **MATMUL_TOL[torch.float32]
    )
