"""Load llama.cpp GGUF checkpoints: config, tokenizer and weights.

A GGUF file carries everything an HF checkpoint spreads over config.json, tokenizer.json and
safetensors, but under llama.cpp's names and layouts. This module translates all three into the
HF shapes the rest of Ember already understands, so the model code never sees GGUF specifics.
Weights are decoded on the CPU with numpy, either to float32 or, for the block-quantized types,
losslessly into Ember's QuantizedWeight form so they can stay quantized.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar

import gguf
import numpy as np
import tokenizers
import torch
from gguf import GGMLQuantizationType as QType
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from ember.model.errors import ModelLoadError
from ember.quant.formats import QuantizedWeight, pack_int4

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# Tokens llama.cpp marks as CONTROL or USER_DEFINED must be matched whole, never split by BPE.
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Same as llama3 except digits are split one by one.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp's llama3 rope scaling, precomputed per frequency; HF derives it from config instead.
_ROPE_FREQS = "rope_freqs.weight"

# Bound on blocks dequantized at once, so a large embedding does not need several
# float32 copies of itself in intermediate arrays.
_BLOCKS_PER_CHUNK = 1 << 16


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """An fp16 field at byte `start` of every block, as a float32 column for broadcasting."""
    return blocks[:, start:start + 2].view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Split bytes [..., n] into [..., 2, n]: low nibbles first, then high nibbles."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-2)


class _Codes(NamedTuple):
    """Decoded blocks in the affine form shared by every type: element i of block b is
    `q[b, i] * scales[b, i // g] + zeros[b, i // g]` (no zeros: symmetric).

    This is already Ember's QuantizedWeight form, so quantized() only re-lays it out, and
    evaluating it in float32 reproduces llama.cpp's own decoding bit for bit (Q4_0 aside, whose
    zero term turns some of llama.cpp's -0.0 into +0.0).
    """

    q: np.ndarray             # [blocks, block size]: int8 codes, or uint8 nibbles for int4 types
    scales: np.ndarray        # float32 [blocks, block size // g]
    zeros: np.ndarray | None  # float32, shape of scales


def _q8_0(blocks: np.ndarray) -> _Codes:
    # [d: fp16][32 x int8]
    return _Codes(blocks[:, 2:].view(np.int8), _fp16(blocks, 0), None)


def _q4_0(blocks: np.ndarray) -> _Codes:
    # [d: fp16][16 bytes: element i in the low nibble of byte i, element i+16 in its high nibble];
    # the value is d * (nibble - 8), i.e. an unsigned nibble with zero term -8d.
    d = _fp16(blocks, 0)
    return _Codes(_nibbles(blocks[:, 2:]).reshape(len(blocks), 32), d, d * np.float32(-8))


def _q4_1(blocks: np.ndarray) -> _Codes:
    # [d: fp16][m: fp16][16 bytes of nibbles as in Q4_0, unsigned]
    return _Codes(_nibbles(blocks[:, 4:]).reshape(len(blocks), 32), _fp16(blocks, 0), _fp16(blocks, 2))


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte field of 8 six-bit scales and 8 six-bit mins used by Q4_K and Q5_K.

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; for sub-blocks 4-7 the
    low 4 bits sit in bytes 8-11 (scale low nibble, min high nibble) and the top 2 bits are the
    spare high bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    lo_sc, lo_min, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([lo_sc & 0x3F, (extra & 0x0F) | ((lo_sc >> 6) << 4)], axis=1)
    mins = np.concatenate([lo_min & 0x3F, (extra >> 4) | ((lo_min >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_affine(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K sub-block scales d*sc and zero terms -(dmin*m).

    llama.cpp computes `d*sc * q - dmin*m`; IEEE defines a - b as a + (-b), so adding the negated
    min gives the same bits.
    """
    scales, mins = _k_scales(blocks[:, 4:16])
    return _fp16(blocks, 0) * scales, -(_fp16(blocks, 2) * mins)


def _q4_k(blocks: np.ndarray) -> _Codes:
    # [d: fp16][dmin: fp16][12 bytes scales/mins][128 bytes: 4 groups of 32 bytes, each holding
    # sub-block 2j in the low nibbles and sub-block 2j+1 in the high nibbles]
    n = len(blocks)
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 256)
    return _Codes(q, *_k_affine(blocks))


def _q5_k(blocks: np.ndarray) -> _Codes:
    # Q4_K's layout with 32 extra bytes (after the scales) whose bit k of byte l is the fifth
    # bit of element l of sub-block k. Codes 0..31 fit int8 as they are.
    n = len(blocks)
    high = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    low = _nibbles(blocks[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    return _Codes((low | (high << 4)).reshape(n, 256).view(np.int8), *_k_affine(blocks))


def _q6_k(blocks: np.ndarray) -> _Codes:
    # [128 bytes low nibbles][64 bytes high 2-bit pairs][16 x int8 scales][d: fp16]. Each half
    # of 128 elements uses 64 low bytes (elements 0-63 low nibbles, 64-127 high nibbles) and
    # 32 high bytes (bit pair k of byte l belongs to element 32k + l); one scale per 16 elements.
    n = len(blocks)
    low = _nibbles(blocks[:, :128].reshape(n, 2, 64)).reshape(n, 2, 128)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 2, 128)
    q = (low | (high << 4)).reshape(n, 256).view(np.int8) - np.int8(32)
    scales = _fp16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return _Codes(q, scales, None)


class _BlockFormat(NamedTuple):
    """How a GGUF block type maps onto a QuantizedWeight."""

    kind: str          # QuantizedWeight kind that holds the codes
    group_size: int    # elements sharing one scale (and zero)
    has_zeros: bool
    decode: Callable[[np.ndarray], _Codes]


_BLOCK_FORMATS: dict[QType, _BlockFormat] = {
    QType.Q8_0: _BlockFormat("int8", 32, False, _q8_0),
    QType.Q4_0: _BlockFormat("int4", 32, True, _q4_0),
    QType.Q4_1: _BlockFormat("int4", 32, True, _q4_1),
    QType.Q4_K: _BlockFormat("int4", 32, True, _q4_k),
    QType.Q5_K: _BlockFormat("int8", 32, True, _q5_k),
    QType.Q6_K: _BlockFormat("int8", 16, False, _q6_k),
}
SUPPORTED_TYPES = frozenset({QType.F32, QType.F16, QType.BF16, *_BLOCK_FORMATS})


def _stored_blocks(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's bytes as uint8 [blocks, block bytes], checked to hold a tensor of `shape`.

    `raw` is whatever GGUFReader exposes (uint8 blocks, or float16/float32 elements); only its
    bytes matter, so any view of the same memory works.
    """
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported tensor type {qtype.name}")
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size or data.size != math.prod(shape) // block_size * block_bytes:
        raise ValueError(f"{data.size} bytes of {qtype.name} do not hold a tensor of shape {shape}")
    return data.reshape(-1, block_bytes)


def _decoded_chunks(
    blocks: np.ndarray, decode: Callable[[np.ndarray], _Codes]
) -> Iterator[tuple[slice, _Codes]]:
    """Decode a bounded number of blocks at a time, so a large embedding never needs several
    whole-tensor intermediate arrays."""
    for start in range(0, len(blocks), _BLOCKS_PER_CHUNK):
        rows = slice(start, start + _BLOCKS_PER_CHUNK)
        yield rows, decode(blocks[rows])


def _dense(codes: _Codes, group_size: int) -> np.ndarray:
    """Evaluate the affine form in float32 as a rounded product, then a rounded sum (never a fused
    multiply-add), the steps llama.cpp's reference takes."""
    n = len(codes.q)
    w = codes.q.reshape(n, -1, group_size).astype(np.float32) * codes.scales[:, :, None]
    if codes.zeros is not None:
        w += codes.zeros[:, :, None]
    return w.reshape(n, -1)


def dequantize(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a tensor's stored bytes (see _stored_blocks) into a float32 array of the given numpy shape."""
    blocks = _stored_blocks(raw, qtype, shape)
    if qtype == QType.F32:
        return blocks.view(np.float32).reshape(shape).copy()
    if qtype == QType.F16:
        return blocks.view(np.float16).astype(np.float32).reshape(shape)
    if qtype == QType.BF16:
        return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    fmt = _BLOCK_FORMATS[qtype]
    out = np.empty((len(blocks), gguf.GGML_QUANT_SIZES[qtype][0]), dtype=np.float32)
    for rows, codes in _decoded_chunks(blocks, fmt.decode):
        out[rows] = _dense(codes, fmt.group_size)
    return out.reshape(shape)


def quantized(raw: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> QuantizedWeight:
    """Re-lay a 2-D block-quantized tensor out as a QuantizedWeight, without rounding anything.

    Every mapped GGUF type is already codes times a per-group scale plus a zero term, so the
    result dequantizes to exactly what dequantize() returns while keeping the file's memory
    footprint (plus float32 scales).
    """
    if qtype not in _BLOCK_FORMATS or len(shape) != 2:
        raise ValueError(f"a {qtype.name} tensor of shape {shape} has no quantized form "
                         f"(2-D tensors of {', '.join(t.name for t in _BLOCK_FORMATS)} only)")
    fmt = _BLOCK_FORMATS[qtype]
    blocks = _stored_blocks(raw, qtype, shape)
    n, block_size = len(blocks), gguf.GGML_QUANT_SIZES[qtype][0]
    if fmt.kind == "int4":
        qweight = torch.empty((n, block_size // 2), dtype=torch.uint8)
    else:
        qweight = torch.empty((n, block_size), dtype=torch.int8)
    scales = np.empty((n, block_size // fmt.group_size), dtype=np.float32)
    zeros = np.empty_like(scales) if fmt.has_zeros else None
    for rows, codes in _decoded_chunks(blocks, fmt.decode):
        # Blocks hold an even number of elements, so packing block by block packs the row.
        if fmt.kind == "int4":
            qweight[rows] = pack_int4(torch.from_numpy(codes.q))
        else:
            qweight.numpy()[rows] = codes.q
        scales[rows] = codes.scales
        if zeros is not None:
            zeros[rows] = codes.zeros
    out_features, in_features = shape
    return QuantizedWeight(
        kind=fmt.kind,
        qweight=qweight.reshape(out_features, -1),
        scales=torch.from_numpy(scales.reshape(out_features, -1)),
        zeros=None if zeros is None else torch.from_numpy(zeros.reshape(out_features, -1)),
        group_size=fmt.group_size,
        in_features=in_features,
    )


def _hf_tensor_name(name: str) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    match = _LAYER_TENSOR_RE.fullmatch(name)
    if match is None or match[2] not in _LAYER_TENSORS:
        return None
    return f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.{match[3]}"


_Rows = TypeVar("_Rows", np.ndarray, torch.Tensor)


def _unpermute(w: _Rows, n_head: int) -> _Rows:
    """Undo llama.cpp's interleaving of rotary halves within each head of q_proj/k_proj rows.

    llama.cpp rotates adjacent pairs (GPT-J style) while HF rotates the two halves of a head, so
    its converter reorders rows; the reshape below is that reordering run backwards.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_weight(w: np.ndarray | QuantizedWeight, n_head: int) -> np.ndarray | QuantizedWeight:
    """_unpermute for either weight form; rows are output channels, so a quantized weight's codes,
    scales and zeros all move together."""
    if isinstance(w, np.ndarray):
        return _unpermute(w, n_head)
    return replace(
        w,
        qweight=_unpermute(w.qweight, n_head),
        scales=_unpermute(w.scales, n_head),
        zeros=None if w.zeros is None else _unpermute(w.zeros, n_head),
    )


@dataclass
class GGUFModel:
    """A GGUF checkpoint translated to HF terms; weights are decoded lazily by tensors()."""

    path: str
    hf_config: dict
    tokenizer: tokenizers.Tokenizer
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int]
    add_bos_token: bool
    chat_template: str | None
    _reader: gguf.GGUFReader = field(repr=False)

    def tensors(self, keep_quantized: bool = False) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
        """Yield (HF name, weight) one tensor at a time, so peak memory stays near one tensor
        beyond the memory-mapped file.

        Weights are float32 arrays, except that with keep_quantized every 2-D block-quantized
        tensor comes as the QuantizedWeight that dequantizes to exactly that array.
        """
        permuted_heads = {}
        if self.hf_config["model_type"] == "llama":
            permuted_heads = {
                "attn_q": self.hf_config["num_attention_heads"],
                "attn_k": self.hf_config["num_key_value_heads"],
            }
        for tensor in self._reader.tensors:
            if tensor.name == _ROPE_FREQS:
                continue
            hf_name = _hf_tensor_name(tensor.name)
            assert hf_name is not None, "load_gguf validated every tensor name"
            shape = _numpy_shape(tensor)
            if keep_quantized and tensor.tensor_type in _BLOCK_FORMATS and len(shape) == 2:
                weight = quantized(tensor.data, tensor.tensor_type, shape)
            else:
                weight = dequantize(tensor.data, tensor.tensor_type, shape)
            match = _LAYER_TENSOR_RE.fullmatch(tensor.name)
            if match is not None and match[2] in permuted_heads:
                weight = _unpermute_weight(weight, permuted_heads[match[2]])
            yield hf_name, weight


def _numpy_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """GGML lists dimensions innermost first; numpy wants them outermost first.

    Leading 1s are dropped because a writer may pad a vector to 2-D, which HF never does.
    """
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


class _Metadata:
    """Typed access to GGUF key/value fields, raising ModelLoadError that names the file."""

    def __init__(self, path: str, reader: gguf.GGUFReader) -> None:
        self.path = path
        self.fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field_ = self.fields.get(key)
        return default if field_ is None else field_.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(self.path, f"GGUF metadata lacks {key!r}")
        return value


def load_gguf(path: str) -> GGUFModel:
    """Open a GGUF file and translate its metadata; weights stay memory-mapped until tensors()."""
    path = str(path)
    if not os.path.exists(path):
        raise ModelLoadError(path, "file not found")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader signals corruption with many exception types
        raise ModelLoadError(path, f"not a valid GGUF file ({type(exc).__name__}: {exc})") from exc
    meta = _Metadata(path, reader)

    arch = meta.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            path, f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})"
        )
    names = {tensor.name for tensor in reader.tensors}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        if _hf_tensor_name(tensor.name) is None:
            raise ModelLoadError(path, f"unexpected tensor {tensor.name!r} for architecture {arch!r}")
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(
                path, f"tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}"
            )

    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [
        token_id
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
        if (token_id := meta.get(f"tokenizer.ggml.{key}")) is not None
    ]
    tokenizer_model = meta.require("tokenizer.ggml.model")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", tokenizer_model == "llama"))
    bos_token = tokens[bos_id] if bos_id is not None else None

    return GGUFModel(
        path=path,
        hf_config=_hf_config(meta, arch, names, len(tokens), bos_id, eos_id),
        tokenizer=_tokenizer(meta, tokenizer_model, tokens, bos_id if add_bos else None),
        bos_token=bos_token,
        eos_token=tokens[eos_id] if eos_id is not None else None,
        eos_token_ids=list(dict.fromkeys(eos_ids)),
        add_bos_token=add_bos,
        chat_template=meta.get("tokenizer.chat_template"),
        _reader=reader,
    )


def _hf_config(
    meta: _Metadata, arch: str, tensor_names: set[str], n_tokens: int,
    bos_id: int | None, eos_id: int | None,
) -> dict:
    hidden = meta.require(f"{arch}.embedding_length")
    heads = meta.require(f"{arch}.attention.head_count")
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": meta.get(f"{arch}.vocab_size", n_tokens),
        "hidden_size": hidden,
        "intermediate_size": meta.require(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.require(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": meta.get(f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": meta.require(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch),
        "max_position_embeddings": meta.require(f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def _rope_scaling(meta: _Metadata, arch: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None or kind == "none":
        return None
    factor = meta.require(f"{arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": meta.require(
                f"{arch}.rope.scaling.original_context_length"
            ),
        }
    raise ModelLoadError(meta.path, f"unsupported rope scaling type {kind!r}")


def _tokenizer(
    meta: _Metadata, model: str, tokens: list[str], bos_id: int | None
) -> tokenizers.Tokenizer:
    """Rebuild the HF tokenizer llama.cpp derived its vocabulary from.

    `bos_id` is the token to prepend to every encoding, or None when the model wants none.
    """
    if model == "gpt2":
        tokenizer = _byte_level_bpe(meta, tokens)
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens)
    else:
        raise ModelLoadError(meta.path, f"unsupported tokenizer model {model!r} (supported: gpt2, llama)")

    token_types = meta.get("tokenizer.ggml.token_type", [])
    tokenizer.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind in (_CONTROL, _USER_DEFINED)
    ])
    if bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tokenizer


def _vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id, keeping the first id when a file repeats a token string."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    return vocab


def _bpe(meta: _Metadata, vocab: dict[str, int], merges: list, **options: Any) -> BPE:
    """A BPE model, reporting a merge that names a missing token as a broken file, not a crash."""
    try:
        return BPE(vocab, merges, **options)
    except Exception as exc:  # tokenizers raises a bare Exception
        raise ModelLoadError(meta.path, f"invalid tokenizer vocabulary ({exc})") from exc


def _byte_level_bpe(meta: _Metadata, tokens: list[str]) -> tokenizers.Tokenizer:
    merges = [tuple(merge.split(" ", 1)) for merge in meta.require("tokenizer.ggml.merges")]
    pre = meta.get("tokenizer.ggml.pre")
    # llama.cpp looks a whole pre-token up in the vocabulary before merging for llama3 only.
    llama3 = pre in ("llama-bpe", "llama3")
    tokenizer = tokenizers.Tokenizer(_bpe(meta, _vocab(tokens), merges, ignore_merges=llama3))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif llama3 or pre == "qwen2":
        split = _LLAMA3_SPLIT if llama3 else _QWEN2_SPLIT
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level,
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: _Metadata, tokens: list[str]) -> tokenizers.Tokenizer:
    """SentencePiece stores scores, not merges; HF recovers BPE merges from them.

    Every token that splits into two vocabulary pieces yields that merge, ranked by the merged
    token's score, so higher-scoring tokens are formed first, as SentencePiece would.
    """
    vocab = _vocab(tokens)
    scores = meta.require("tokenizer.ggml.scores")
    candidates = [
        (-scores[index], vocab[token[:cut]], vocab[token[cut:]])
        for token, index in vocab.items()
        for cut in range(1, len(token))
        if token[:cut] in vocab and token[cut:] in vocab
    ]
    candidates.sort()
    merges = [(tokens[left], tokens[right]) for _, left, right in candidates]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else ("<unk>" if "<unk>" in vocab else None)
    tokenizer = tokenizers.Tokenizer(
        _bpe(meta, vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    space = "\u2581"
    tokenizer.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(space)] if add_space_prefix else [])
        + [normalizers.Replace(" ", space)]
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    return tokenizer
