"""Random-weight GGUF files of any tensor-type mix, for tests and the load-speed benchmark.

Quantized tensors are random block bytes with their fp16 scale fields overwritten by small finite
values: every GGUF type decodes from such bytes (gguf's numpy code cannot quantize most of them),
and the values stay in a range a forward pass survives. `q4_k_m_type` picks types the way
llama.cpp's `llama-quantize ... Q4_K_M` does, so a file of a real model's shape has a real mix.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

# Byte offsets of every fp16 field (scales, mins) in one block of each type. IQ1_M spreads its
# scale over the top nibbles of four 16-bit words (any bytes decode finitely, if not always
# usefully); MXFP4's one-byte power of two is set apart (_MXFP4_EXPONENTS).
FP16_FIELDS: dict[QType, tuple[int, ...]] = {
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q5_0: (0,),
    QType.Q5_1: (0, 2),
    QType.Q8_0: (0,),
    QType.Q2_K: (80, 82),
    QType.Q3_K: (108,),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
    QType.IQ4_NL: (0,),
    QType.IQ4_XS: (0,),
    QType.IQ3_XXS: (0,),
    QType.IQ3_S: (0,),
    QType.IQ2_XXS: (0,),
    QType.IQ2_XS: (0,),
    QType.IQ2_S: (0,),
    QType.IQ1_S: (0,),
    QType.IQ1_M: (),
    QType.TQ1_0: (52,),
    QType.TQ2_0: (64,),
    QType.MXFP4: (),
}
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)
# Every type llama.cpp's llama-quantize writes.
ALL_TYPES = (*FLOAT_TYPES, *FP16_FIELDS)
_MXFP4_EXPONENTS = (117, 123)  # block scales 2^-11 .. 2^-6, as trained weights have
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def random_tensor(qtype: QType, shape: tuple[int, ...], rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """Stored bytes (float arrays for float types) of a tensor of numpy shape `shape`."""
    if qtype in FLOAT_TYPES:
        values = rng.standard_normal(shape, dtype=np.float32) * scale
        return values.astype(np.float16) if qtype == QType.F16 else gguf.quants.quantize(values, qtype)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (math.prod(shape) // block_size, block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        field = (rng.standard_normal(len(blocks), dtype=np.float32) * scale / 8).astype(np.float16)
        blocks[:, offset : offset + 2] = field.view(np.uint8).reshape(-1, 2)
    if qtype == QType.MXFP4:
        blocks[:, 0] = rng.integers(*_MXFP4_EXPONENTS, len(blocks))
    return blocks.reshape(*shape[:-1], -1)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    arch: str = "qwen2"  # qwen2 carries q/k/v biases; llama permutes q/k rows


QWEN25_1_5B = ModelShape(hidden=1536, layers=28, ffn=8960, heads=12, kv_heads=2, vocab=151936)
# Qwen2-0.5B(-Instruct): rows of 896 are no multiple of 256, so its Q4_K_M file is mostly Q5_0 (and Q8_0 for
# the tied embedding and half the attn_v), with K-quants only in ffn_down (rows of 4864), as llama.cpp writes it.
QWEN2_0_5B = ModelShape(hidden=896, layers=24, ffn=4864, heads=14, kv_heads=2, vocab=151936)
# Shapes a benchmark can write with one flag (`benchmarks/cpu.py --synthetic NAME`), all in the Q4_K_M mix.
SHAPES = {"qwen2-0.5b": QWEN2_0_5B, "qwen2.5-1.5b": QWEN25_1_5B}
DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "ember", "bench")

TypeChooser = Callable[[str, tuple[int, ...], int], QType]  # (GGUF name, numpy shape, layers) -> type


def q4_k_m_type(name: str, shape: tuple[int, ...], layers: int) -> QType:
    """llama.cpp's Q4_K_M choice: Q6_K for the output (or a tied embedding) and for attn_v/ffn_down
    in the first and last eighth of layers and every third layer between; Q4_K elsewhere; the
    fallbacks Q5_0 (for Q4_K) and Q8_0 (for Q6_K) where a row is not a multiple of 256; F32 vectors."""
    if len(shape) == 1:
        return QType.F32
    wide = name in ("output.weight", "token_embd.weight")
    if name.startswith("blk.") and name.split(".")[2] in ("attn_v", "ffn_down"):
        i = int(name.split(".")[1])
        wide = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
    if shape[-1] % 256:
        return QType.Q8_0 if wide else QType.Q5_0
    return QType.Q6_K if wide else QType.Q4_K


def tensor_shapes(s: ModelShape) -> dict[str, tuple[int, ...]]:
    """GGUF tensor names and numpy shapes of a model with a tied embedding."""
    head_dim = s.hidden // s.heads
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (s.vocab, s.hidden), "output_norm.weight": (s.hidden,)}
    for i in range(s.layers):
        p = f"blk.{i}."
        shapes |= {
            p + "attn_norm.weight": (s.hidden,),
            p + "ffn_norm.weight": (s.hidden,),
            p + "attn_q.weight": (s.heads * head_dim, s.hidden),
            p + "attn_k.weight": (s.kv_heads * head_dim, s.hidden),
            p + "attn_v.weight": (s.kv_heads * head_dim, s.hidden),
            p + "attn_output.weight": (s.hidden, s.heads * head_dim),
            p + "ffn_gate.weight": (s.ffn, s.hidden),
            p + "ffn_up.weight": (s.ffn, s.hidden),
            p + "ffn_down.weight": (s.hidden, s.ffn),
        }
        if s.arch == "qwen2":
            shapes |= {
                p + "attn_q.bias": (s.heads * head_dim,),
                p + "attn_k.bias": (s.kv_heads * head_dim,),
                p + "attn_v.bias": (s.kv_heads * head_dim,),
            }
    return shapes


def write_model(path: str, s: ModelShape, choose: TypeChooser = q4_k_m_type, seed: int = 0) -> dict[str, QType]:
    """Write a random-weight model with a byte-level BPE vocabulary (one merge); return each tensor's type.

    Norm weights are ones, so activations keep their scale through the layers."""
    rng = np.random.default_rng(seed)
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    tokens = _SPECIALS + [chr(b) if b in printable else chr(next(extra)) for b in range(256)] + ["ab"]
    tokens += [f"<tok{i}>" for i in range(s.vocab - len(tokens))]
    writer = gguf.GGUFWriter(path, s.arch)
    writer.add_context_length(4096)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.ffn)
    writer.add_block_count(s.layers)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(_SPECIALS) + [1] * (len(tokens) - len(_SPECIALS)))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    types = {}
    for name, shape in tensor_shapes(s).items():
        types[name] = qtype = choose(name, shape, s.layers)
        if name.endswith("norm.weight"):
            data = gguf.quants.quantize(np.ones(shape, dtype=np.float32), qtype)
        else:
            data = random_tensor(qtype, shape, rng)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (QType.F32, QType.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def cached_model(shape: ModelShape, name: str, cache_dir: str = DEFAULT_CACHE_DIR) -> str:
    """The path of a random-weight Q4_K_M-mix file of `shape` in `cache_dir`, written on first use (tens of
    seconds for a 0.5B shape; a partial file never takes the final name)."""
    path = os.path.join(cache_dir, f"{name}-shape-q4_k_m-random-{shape.layers}l.gguf")
    if not os.path.exists(path):
        os.makedirs(cache_dir, exist_ok=True)
        print(f"writing {path} ...", flush=True)
        write_model(path + ".partial", shape)
        os.replace(path + ".partial", path)
    return path
