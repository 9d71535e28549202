"""Pre-quantized HF checkpoints (AWQ, GPTQ, compressed-tensors, fp8) load without re-quantizing.

Each test quantizes a tiny checkpoint's projections and packs them as the format's published
layout describes (the packers below are written from AutoAWQ's, AutoGPTQ/GPTQModel's,
compressed-tensors' and transformers' descriptions of their files, independently of Ember's
readers). The loaded weights must equal the format's dequantization computed in float32 bit for
bit, and an engine on the quantized checkpoint must give the greedy tokens of one on a plain
checkpoint holding those dequantized weights.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import make_checkpoint
from safetensors.torch import load_file, save_file

from ember import LLM, EngineArgs, SamplingParams
from ember.errors import ModelLoadError
from ember.model.linear import QuantLinear
from ember.model.loader import ModelFiles, load_model_files
from ember.quant.checkpoints import gptq
from ember.quant.formats import QuantizedWeight, dense_weight

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = ["The quick brown fox jumps", "def add(a, b):\n"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: word nibble i holds column AWQ_ORDER[i] of its 8


# ---- packers, from each format's description ------------------------------------------------


def _words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] unsigned codes -> int32 [R, ceil(C * bits / 32)], code i of each run in bits i*bits.."""
    per = 32 // bits
    values = torch.nn.functional.pad(values.long(), (0, -values.shape[1] % per))
    words = torch.zeros(values.shape[0], values.shape[1] // per, dtype=torch.int64)
    for i in range(per):
        words |= values[:, i::per] << (bits * i)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # the same 32 bits as int32


@dataclass
class IntQuant:
    """w ~ (q - z[:, g_idx]) * s[:, g_idx] with unsigned `bits`-bit q: [N, K], z and s: [N, G]."""

    q: torch.Tensor
    z: torch.Tensor
    s: torch.Tensor
    g_idx: torch.Tensor

    def reference(self) -> torch.Tensor:
        return (self.q - self.z[:, self.g_idx]).float() * self.s[:, self.g_idx].float()


def int_quantize(
    w: torch.Tensor, bits: int, group: int, sym: bool, scale_dtype=torch.float16, act_order: bool = False, seed: int = 0
) -> IntQuant:
    n, k = w.shape
    group = k if group == -1 else group
    g_idx = torch.arange(k) // group
    if act_order:  # GPTQ's desc_act: group i // group holds the i-th column in a (here random) order
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty_like(g_idx).index_put_((perm,), g_idx)
    top = 2**bits - 1
    groups = int(g_idx.max()) + 1
    q = torch.zeros(n, k, dtype=torch.int64)
    z = torch.zeros(n, groups, dtype=torch.int64)
    s = torch.zeros(n, groups, dtype=scale_dtype)
    for j in range(groups):
        cols = g_idx == j
        part = w[:, cols]
        if sym:
            scale = (part.abs().amax(1) * 2 / top).to(scale_dtype)
            zero = torch.full((n,), 2 ** (bits - 1), dtype=torch.int64)
        else:
            lo, hi = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
            scale = ((hi - lo) / top).to(scale_dtype)
            zero = torch.round(-lo / scale.float()).long().clamp(0, top)
        q[:, cols] = (torch.round(part / scale.float()[:, None]).long() + zero[:, None]).clamp(0, top)
        z[:, j], s[:, j] = zero, scale
    return IntQuant(q, z, s, g_idx)


def pack_awq(iq: IntQuant) -> dict[str, torch.Tensor]:
    def interleave(v: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R, C] in AWQ's nibble order
        return v.view(v.shape[0], -1, 8)[:, :, list(AWQ_ORDER)].reshape(v.shape)

    return {
        "qweight": _words(interleave(iq.q.t()), 4),
        "qzeros": _words(interleave(iq.z.t()), 4),
        "scales": iq.s.t().contiguous(),
    }


def pack_gptq(iq: IntQuant, bits: int, v2: bool) -> dict[str, torch.Tensor]:
    stored_zeros = (iq.z - (0 if v2 else 1)) & (2**bits - 1)  # v1 stores zero - 1
    return {
        "qweight": _words(iq.q, bits).t().contiguous(),
        "qzeros": _words(stored_zeros.t(), bits),
        "scales": iq.s.t().contiguous(),
        "g_idx": iq.g_idx.to(torch.int32),
    }


def pack_compressed(iq: IntQuant, bits: int, sym: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors stores signed values (q - 2^(bits-1)) shifted back by 2^(bits-1): the same codes."""
    offset = 2 ** (bits - 1)
    tensors = {
        "weight_packed": _words(iq.q, bits),
        "weight_scale": iq.s.contiguous(),
        "weight_shape": torch.tensor(list(iq.q.shape), dtype=torch.int64),
    }
    if not sym:  # signed zero points, packed along the output dimension
        signed_zero = iq.z - offset
        tensors["weight_zero_point"] = _words(signed_zero.t() + offset, bits).t().contiguous()
    if not torch.equal(iq.g_idx, torch.arange(iq.q.shape[1]) // (iq.q.shape[1] // iq.s.shape[1])):
        tensors["weight_g_idx"] = iq.g_idx.to(torch.int32)
    return tensors


def fp8_quantize(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 codes, scale per block, float32 reference); block None: per output channel."""
    n, k = w.shape
    rows, cols = block or (1, k)
    nb, kb = -(-n // rows), -(-k // cols)
    padded = torch.nn.functional.pad(w, (0, kb * cols - k, 0, nb * rows - n))
    amax = padded.abs().view(nb, rows, kb, cols).amax(dim=(1, 3))
    scale = amax / 448.0
    expanded = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    codes = (w / expanded).to(torch.float8_e4m3fn)
    return codes, scale, codes.float() * expanded


# ---- checkpoints ---------------------------------------------------------------------------


@dataclass
class Case:
    """One quantized checkpoint: how to quantize each projection and the quantization_config."""

    name: str
    config: dict
    kind: str  # the QuantizedWeight kind it loads as
    pack: object  # (module name, float weight [N, K]) -> (tensors by suffix, float32 reference)
    arch: str = "llama"
    dense_modules: tuple[str, ...] = field(default=())  # projections stored unquantized (ignore lists)


def _int_case(name, config, bits, group, sym, packer, scale_dtype=torch.float16, act_order=False, **kw) -> Case:
    def pack(module: str, w: torch.Tensor):
        # the seed is the name's length: q/k/v share a column order (they fuse), gate/up do not
        iq = int_quantize(w, bits, group, sym, scale_dtype, act_order, seed=len(module))
        return packer(iq), iq.reference()

    return Case(name, config, f"int{bits}", pack, **kw)


def _fp8_case(name, config, block, scale_name="weight_scale", per_tensor=False, **kw) -> Case:
    def pack(module: str, w: torch.Tensor):
        if per_tensor:
            scale = w.abs().amax().reshape(1) / 448.0
            codes = (w / scale).to(torch.float8_e4m3fn)
            return {"weight": codes, scale_name: scale}, codes.float() * scale
        codes, scale, reference = fp8_quantize(w, block)
        return {"weight": codes, scale_name: scale}, reference

    return Case(name, config, "fp8", pack, **kw)


def _ct_config(fmt: str, weights: dict, ignore=("lm_head",)) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": fmt,
                "input_activations": None,
                "output_activations": None,
                "weights": {"dynamic": False, "observer": "minmax", "actorder": None, **weights},
            }
        },
    }


def _ct_mixed_config() -> dict:
    """W4A16 for every Linear, W8A16 for down_proj through a more specific pattern, o_proj ignored."""
    config = _ct_config(
        "pack-quantized",
        {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16},
        ignore=("lm_head", "re:.*o_proj"),
    )
    w8 = {
        **config["config_groups"]["group_0"],
        "targets": ["re:.*down_proj$"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
    }
    return {**config, "config_groups": {**config["config_groups"], "group_1": w8}}


def _mixed_pack(module: str, w: torch.Tensor):
    bits, group = (8, -1) if "down_proj" in module else (4, 16)
    iq = int_quantize(w, bits, group, True, torch.bfloat16)
    return pack_compressed(iq, bits, True), iq.reference()


def _gptq_config(bits, group, desc_act, sym, fmt="gptq") -> dict:
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": fmt,
        "damp_percent": 0.01,
        "true_sequential": True,
    }


# Group sizes of 16 keep int4 weights off PyTorch's packed CPU kernels (groups of 32-256, bf16
# activations), so an engine computes with exactly the dequantized float32 weights.
CASES = {
    c.name: c
    for c in [
        _int_case(
            "awq-qwen2",
            {
                "quant_method": "awq",
                "bits": 4,
                "group_size": 16,
                "zero_point": True,
                "version": "gemm",
                "modules_to_not_convert": None,
            },
            4,
            16,
            False,
            pack_awq,
            arch="qwen2",
        ),
        _int_case("gptq4-sym-v1", _gptq_config(4, 16, False, True), 4, 16, True, lambda iq: pack_gptq(iq, 4, False)),
        _int_case(
            "gptq4-asym-act-order-v2",
            _gptq_config(4, 16, True, False, "gptq_v2"),
            4,
            16,
            False,
            lambda iq: pack_gptq(iq, 4, True),
            act_order=True,
        ),
        _int_case(
            "gptq8-sym-act-order",
            _gptq_config(8, 32, True, True),
            8,
            32,
            True,
            lambda iq: pack_gptq(iq, 8, False),
            act_order=True,
        ),
        _int_case(
            "gptq8-asym-channel", _gptq_config(8, -1, False, False), 8, -1, False, lambda iq: pack_gptq(iq, 8, False)
        ),
        _int_case(
            "ct-w4a16-sym",
            _ct_config(
                "pack-quantized",
                {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16},
            ),
            4,
            16,
            True,
            lambda iq: pack_compressed(iq, 4, True),
            scale_dtype=torch.bfloat16,
        ),
        _int_case(
            "ct-w4a16-asym-ignore",
            _ct_config(
                "pack-quantized",
                {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 16},
                ignore=("lm_head", "re:.*down_proj$"),
            ),
            4,
            16,
            False,
            lambda iq: pack_compressed(iq, 4, False),
            scale_dtype=torch.bfloat16,
            dense_modules=("down_proj",),
        ),
        Case("ct-mixed-w4-w8", _ct_mixed_config(), "int4", _mixed_pack, dense_modules=("o_proj",)),
        _int_case(
            "ct-w8a16-asym-channel",
            _ct_config("pack-quantized", {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}),
            8,
            -1,
            False,
            lambda iq: pack_compressed(iq, 8, False),
            scale_dtype=torch.bfloat16,
        ),
        _fp8_case(
            "ct-fp8-channel",
            _ct_config("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}),
            None,
        ),
        _fp8_case(
            "ct-fp8-tensor",
            _ct_config("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}),
            None,
            per_tensor=True,
        ),
        _fp8_case(
            "ct-fp8-block",
            _ct_config(
                "float-quantized",
                {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [32, 32]},
            ),
            (32, 32),
        ),
        _fp8_case(
            "hf-fp8-block128",
            {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
            (128, 128),
            "weight_scale_inv",
        ),
        _fp8_case(
            "hf-fp8-block32",
            {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
            (32, 32),
            "weight_scale_inv",
        ),
        # some block-scaled files name the block scales weight_scale
        _fp8_case(
            "hf-fp8-block32-weight-scale",
            {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
            (32, 32),
        ),
    ]
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prequant-base")
    return {arch: make_checkpoint(root / arch, arch) for arch in ("llama", "qwen2")}


def _is_projection(name: str) -> str | None:
    parts = name.split(".")
    return parts[-2] if len(parts) > 2 and parts[-2] in PROJECTIONS and parts[-1] == "weight" else None


def write_case(case: Case, base: Path, root: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """The quantized checkpoint, its dequantized float32 twin, and the reference weight of each
    quantized projection."""
    quant_dir, dense_dir = root / case.name, root / f"{case.name}-dense"
    tensors = load_file(base / "model.safetensors")
    quantized, dense, references = {}, {}, {}
    for name, w in tensors.items():
        module = _is_projection(name)
        if module is None or module in case.dense_modules:
            quantized[name] = dense[name] = w
            continue
        parts, reference = case.pack(name, w.float())
        prefix = name.removesuffix(".weight")
        quantized.update({f"{prefix}.{suffix}": t for suffix, t in parts.items()})
        dense[name] = references[name] = reference
    config = json.loads((base / "config.json").read_text())
    for directory, state, cfg in (
        (quant_dir, quantized, {**config, "quantization_config": case.config}),
        (dense_dir, dense, config),
    ):
        directory.mkdir()
        save_file(state, directory / "model.safetensors")
        (directory / "config.json").write_text(json.dumps(cfg))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(base / f, directory / f)
    return quant_dir, dense_dir, references


def loaded_weights(path: Path, **kwargs) -> tuple[ModelFiles, dict]:
    files = load_model_files(EngineArgs(model=str(path), **kwargs).load_config())
    return files, dict(files.weights())


@pytest.mark.parametrize("name", sorted(CASES))
def test_loaded_weights_equal_the_dequantized_reference(name, bases, tmp_path):
    case = CASES[name]
    quant_dir, _, references = write_case(case, bases[case.arch], tmp_path)
    files, weights = loaded_weights(quant_dir)
    assert files.prequantized and files.quantization == case.config["quant_method"]
    assert not files.quantize_at_load
    for tensor_name, reference in references.items():
        w = weights[tensor_name]
        assert isinstance(w, QuantizedWeight), tensor_name
        assert w.kind == ("int8" if case.name == "ct-mixed-w4-w8" and "down_proj" in tensor_name else case.kind)
        assert torch.equal(dense_weight(w), reference), tensor_name
    for module in case.dense_modules:  # ignored modules load as the plain tensors they are
        assert all(not isinstance(w, QuantizedWeight) for n, w in weights.items() if f".{module}." in n)
    if "block" in case.name:
        assert (
            weights["model.layers.0.mlp.down_proj.weight"].block_rows == case.config.get("weight_block_size", [32])[0]
        )


def _greedy(path: Path, tp: int = 1) -> list[list[int]]:
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        kv_cache_memory=0.02,
        max_model_len=128,
        seed=0,
        tensor_parallel_size=tp,
        engine_process=False if tp == 1 else None,
    )
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("name", ["awq-qwen2", "gptq4-asym-act-order-v2", "ct-w4a16-asym-ignore"])
def test_greedy_tokens_equal_the_dequantized_float_model(name, bases, tmp_path):
    """Weight-only formats. fp8 checkpoints run W8A8 (activations quantized per token group, on the
    CPU an exact emulation of the GPU), so their tokens follow the fp8 arithmetic, not the float
    model's: their weights' exactness is checked above and the W8A8 path in tests/test_fp8.py."""
    case = CASES[name]
    quant_dir, dense_dir, _ = write_case(case, bases[case.arch], tmp_path)
    assert _greedy(quant_dir) == _greedy(dense_dir)


def test_tensor_parallel_splits_gptq_weights_like_one_rank(bases, tmp_path):
    """TP=2 narrows the loaded int4 weights: rows for q/k/v and gate/up, whole groups of columns for
    o_proj and down_proj (two and four groups of 16 per rank)."""
    quant_dir, _, _ = write_case(CASES["gptq4-sym-v1"], bases["llama"], tmp_path)
    assert _greedy(quant_dir, tp=2) == _greedy(quant_dir)


def test_act_order_weight_cannot_split_by_columns(bases, tmp_path):
    quant_dir, _, _ = write_case(CASES["gptq4-asym-act-order-v2"], bases["llama"], tmp_path)
    _, weights = loaded_weights(quant_dir)
    w = weights["model.layers.0.self_attn.o_proj.weight"]
    assert w.in_perm is not None
    assert torch.equal(dense_weight(w.narrow(0, 16, 32)), dense_weight(w)[16:48])
    with pytest.raises(ValueError, match="act-order"):
        w.narrow(1, 0, 32)


@pytest.mark.parametrize("seeds,fused_parts", [((1, 1, 1), 1), ((1, 1, 2), 3)])
def test_act_order_layer_on_the_packed_kernel(seeds, fused_parts):
    """int4 act-order weights on the packed CPU kernel (group 32, bf16 activations: a tolerance):
    parts that share one column order fuse into one matmul, others run one matmul each."""
    gen = torch.Generator().manual_seed(3)
    k = 64
    reader = gptq.read(
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2"}, "config.json"
    )
    weights = []
    for seed in seeds:
        iq = int_quantize(torch.randn(32, k, generator=gen) * 0.1, 4, 32, False, act_order=True, seed=seed)
        weights.append((reader.assemble("m", pack_gptq(iq, 4, True)), iq.reference()))
    layer = QuantLinear([w for w, _ in weights], None, torch.float32)
    assert len(layer.parts) == fused_parts
    x = torch.randn(5, k, generator=gen)
    expected = x @ torch.cat([r for _, r in weights]).T
    torch.testing.assert_close(layer(x), expected, atol=2e-2 * expected.abs().max().item(), rtol=0)


def _with_config(bases, tmp_path, qcfg: dict) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(bases["llama"], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": qcfg}))
    return path


@pytest.mark.parametrize(
    "qcfg,message",
    [
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"},
            r"quantization_config.version = 'gemv' is not supported .*'gemm'",
        ),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"quantization_config.bits = 3 .*4, 8"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
            r"checkpoint_format = 'marlin'.*'gptq', 'gptq_v2'",
        ),
        (
            {
                **_ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"}),
                "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
            },
            r"kv_cache_scheme: calibrated",
        ),
        ({"quant_method": "bitsandbytes"}, r"quant_method = 'bitsandbytes' .*awq, gptq, compressed-tensors, fp8"),
        (
            _ct_config("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"}),
            r"config_groups.group_0.format = 'int-quantized' .*pack-quantized, float-quantized",
        ),
    ],
)
def test_unsupported_variants_name_the_file_and_field(bases, tmp_path, qcfg, message):
    path = _with_config(bases, tmp_path, qcfg)
    with pytest.raises(ModelLoadError, match=message) as err:
        load_model_files(EngineArgs(model=str(path)).load_config())
    assert err.value.path == str(path / "config.json")


def test_explicit_quantization_must_agree_with_the_checkpoint(bases, tmp_path):
    path = _with_config(bases, tmp_path, CASES["hf-fp8-block32"].config)
    assert load_model_files(EngineArgs(model=str(path), quantization="fp8").load_config()).quantization == "fp8"
    with pytest.raises(
        ValueError,
        match=r"'int4' conflicts with the checkpoint's quantization_config.quant_method "
        r"'fp8'",
    ):
        load_model_files(EngineArgs(model=str(path), quantization="int4").load_config())
    with pytest.raises(ValueError, match="'gptq' needs a checkpoint stored that way"):
        load_model_files(EngineArgs(model=str(bases["llama"]), quantization="gptq").load_config())


def test_missing_part_is_a_clear_error(bases, tmp_path):
    quant_dir, _, _ = write_case(CASES["gptq4-sym-v1"], bases["llama"], tmp_path)
    tensors = load_file(quant_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.scales"]
    save_file(tensors, quant_dir / "model.safetensors")
    with pytest.raises(
        ModelLoadError,
        match=r"'model.layers.1.mlp.up_proj' has no tensor "
        r"model.layers.1.mlp.up_proj.scales",
    ):
        loaded_weights(quant_dir)


@pytest.mark.parametrize(
    "name,gate_up_parts", [("gptq4-sym-v1", 1), ("gptq4-asym-act-order-v2", 2), ("ct-fp8-block", 1)]
)
def test_loaded_projections_fuse_when_their_formats_agree(name, gate_up_parts, bases, tmp_path):
    """q/k/v share a format (and, with act-order, a column order) and fuse into one matmul; gate and
    up fuse too unless their column orders differ (here they do for the act-order file)."""
    quant_dir, _, _ = write_case(CASES[name], bases["llama"], tmp_path)
    _, weights = loaded_weights(quant_dir)
    layer = "model.layers.0"
    qkv = QuantLinear([weights[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"], None, torch.float32)
    gate_up = QuantLinear([weights[f"{layer}.mlp.{p}_proj.weight"] for p in ("gate", "up")], None, torch.float32)
    assert (len(qkv.parts), len(gate_up.parts)) == (1, gate_up_parts)
