"""LoRA on the CPU's native kernels: the gathered delta (ember/cpu_native lora.c) against the float64 reference
in the AVX-512 build and the plain-C one, and end to end on a quantized tiny Llama, the whole-layer native
decode with the deltas inside against the layers' modules (bit for bit), a mixed batch against each request
alone (bit for bit), and against PyTorch's one-hot delta (TorchLoRA)."""

from __future__ import annotations

import pytest
import test_cpu_native as base
import torch
from conftest import make_checkpoint
from test_cpu_native_fused import _layer_by_layer
from test_lora import ALL, make_adapter

from ember import LLM, LoRARequest, SamplingParams
from ember.cpu_native import ops
from ember.ops import lora, registry

pytestmark = base.pytestmark
native_on, plain_c, kernels = base.native_on, base.plain_c, base.kernels


def _reference(x: torch.Tensor, a: torch.Tensor, b: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The delta row by row in float64."""
    rank = b[0].shape[1]
    out = torch.zeros(x.shape[0], sum(t.shape[2] for t in b), dtype=torch.float64)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            xa = a[s].double() @ x[t].double()
            out[t] = torch.cat([xa[i * rank : (i + 1) * rank] @ bi[s].double() for i, bi in enumerate(b)])
    return out


@pytest.mark.parametrize(
    ("widths", "k", "rows"),
    [([48, 16, 16], 40, 7), ([40], 72, 5), ([96, 96], 24, 9), ([600], 576, 33)],  # the last: the parallel loops
)
def test_lora_delta_matches_float64_reference(kernels, widths: list[int], k: int, rows: int) -> None:
    """Rows under 3 of 4 slots and none, slots shared and not, column tails: the delta added to y, each row
    the same bits alone as in the batch, the PyTorch one-hot form (TorchLoRA) close; a bad slot refused."""
    gen = torch.Generator().manual_seed(sum(widths) + k)
    num_slots, rank = 4, 8
    a = torch.randn(num_slots, len(widths) * rank, k, generator=gen)
    b = [torch.randn(num_slots, rank, n, generator=gen) for n in widths]
    x = torch.randn(rows, k, generator=gen) / k**0.5  # xa of unit scale
    slots = torch.tensor([(-1, 0, 2, 3, 2, -1, 0)[t % 7] for t in range(rows)], dtype=torch.int32)
    y0 = torch.randn(rows, sum(widths), generator=gen)
    y = y0.clone()
    ops.lora_delta(x, y, (a, b), slots)
    want = y0.double() + _reference(x, a, b, slots)
    torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-5)
    assert torch.equal(y[slots < 0], y0[slots < 0])
    for t in range(rows):
        alone = y0[t : t + 1].clone()
        ops.lora_delta(x[t : t + 1], alone, (a, b), slots[t : t + 1])
        assert torch.equal(alone[0], y[t])
    torch_y = y0.clone()
    lora.TorchLoRA()(x, torch_y, lora.LoRAWeights(a, b, [sum(widths[:i]) for i in range(len(widths))]), slots)
    torch.testing.assert_close(torch_y, y, atol=1e-4, rtol=1e-5)
    with pytest.raises(IndexError, match="LoRA slot 4"):
        ops.lora_delta(x, y, (a, b), torch.full((rows,), 4, dtype=torch.int32))


@pytest.mark.parametrize(
    ("kind", "bf16", "bias", "widths", "rows"),
    [
        ("int4", False, False, [320, 64, 64], 16),  # a decode step's QKV: the parallel region
        ("int4", False, True, [576], 9),  # Qwen2's QKV bias
        ("int5", False, False, [1536, 1536], 5),  # gate/up
        ("int8", False, True, [38, 26], 3),  # under the GEMV's parallel threshold, a column tail
        ("int4", True, False, [320, 62], 16),  # bf16 arithmetic
        ("int5", True, True, [1536, 1536], 5),
        ("int8", True, False, [38, 26], 17),
    ],
)
def test_gemv_lora_is_the_gemv_then_the_delta(kernels, kind, bf16, bias, widths, rows, monkeypatch) -> None:
    """The GEMV (+ bias) and the delta in one parallel region (gemv_lora, what decode_layers and LoRALinear
    run) equal ops.matmul, the bias and lora_delta one after the other bit for bit, on two threads, each row
    the same alone; rows without an adapter the GEMV alone; no adapter rows at all, the GEMV (+ bias)."""
    if bf16 and not ops.has_bf16():
        pytest.skip("this CPU has no AVX512_BF16")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    gen = torch.Generator().manual_seed(sum(widths) + rows)
    k, num_slots, rank = 576, 4, 16
    zeros = kind == "int4" or not bf16  # int5/int8 in bf16 arithmetic: weights without zeros
    w = ops.native_weight(base._weight(kind, sum(widths), k, 32, zeros, seed=rows), bf16=bf16)
    a = torch.randn(num_slots, len(widths) * rank, k, generator=gen)
    b = [torch.randn(num_slots, rank, n, generator=gen) for n in widths]
    x = torch.randn(rows, k, generator=gen) / k**0.5
    bias_t = torch.randn(sum(widths), generator=gen) if bias else None
    slots = torch.tensor([(-1, 0, 2, 3, 2, -1, 0)[t % 7] for t in range(rows)], dtype=torch.int32)
    want = ops.matmul(x, w)
    if bias_t is not None:
        want = want + bias_t
    base_only = want.clone()
    ops.lora_delta(x, want, (a, b), slots)
    got = ops.matmul_lora(x, w, bias_t, (a, b), slots)
    assert torch.equal(got, want)
    assert torch.equal(got[slots < 0], base_only[slots < 0])
    for t in range(rows):
        assert torch.equal(ops.matmul_lora(x[t : t + 1], w, bias_t, (a, b), slots[t : t + 1])[0], want[t])
    assert torch.equal(ops.matmul_lora(x, w, bias_t, (a, b), torch.full((rows,), -1, dtype=torch.int32)), base_only)
    with pytest.raises(IndexError, match="LoRA slot 4"):
        ops.matmul_lora(x, w, bias_t, (a, b), torch.full((rows,), 4, dtype=torch.int32))


@pytest.mark.parametrize(("widths", "k", "rows"), [([48, 16, 16], 40, 7), ([600], 576, 33), ([1536, 1536], 576, 5)])
def test_bfloat16_slots_give_the_float32_numbers_of_their_values(kernels, widths, k, rows, monkeypatch) -> None:
    """bfloat16 slots (`--lora-dtype bfloat16`) widen to float32 exactly in the kernels: lora_delta and
    gemv_lora over them equal, bit for bit, the float32 kernels over the same values (column tails, the
    parallel loops included; K = 40 a tail of the shrink's loads); slots of two dtypes, or float16, are not
    taken."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    gen = torch.Generator().manual_seed(rows)
    num_slots, rank = 4, 8
    a16 = torch.randn(num_slots, len(widths) * rank, k, generator=gen).bfloat16()
    b16 = [torch.randn(num_slots, rank, n, generator=gen).bfloat16() for n in widths]
    a32, b32 = a16.float(), [t.float() for t in b16]
    x = torch.randn(rows, k, generator=gen) / k**0.5
    slots = torch.tensor([(-1, 0, 2, 3, 2, -1, 0)[t % 7] for t in range(rows)], dtype=torch.int32)
    y0 = torch.randn(rows, sum(widths), generator=gen)
    got, want = y0.clone(), y0.clone()
    ops.lora_delta(x, got, (a16, b16), slots)
    ops.lora_delta(x, want, (a32, b32), slots)
    assert torch.equal(got, want) and not torch.equal(got, y0)
    if k % 32 == 0:  # the GEMV's groups
        w = ops.native_weight(base._weight("int4", sum(widths), k, 32, True, seed=rows))
        want = ops.matmul_lora(x, w, None, (a32, b32), slots)
        assert torch.equal(ops.matmul_lora(x, w, None, (a16, b16), slots), want)
    assert not ops.lora_fits(a16, b32) and not ops.lora_fits(a16.half(), [t.half() for t in b16])
    with pytest.raises(ValueError, match="do not fit"):
        ops.lora_delta(x, got, (a16, b32), slots)


def test_silu_mul_matches_the_fused_gemv_silu(kernels) -> None:
    y = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(0)) * 4
    torch.testing.assert_close(ops.silu_mul(y), torch.nn.functional.silu(y[:, :40]) * y[:, 40:], atol=1e-5, rtol=1e-5)


PROMPTS = ["hello world", "the quick brown fox jumps", "a b c d e f g h i j k l m n o p q r s"]


def test_native_decode_keeps_the_deltas(tmp_path, monkeypatch) -> None:
    """int8 tiny Llama, two adapters and the base: decode steps run ops.decode_layers with the adapter rows'
    slots (and without any where no row has one); a mixed batch equals each request alone, and the layers'
    modules (LoRALinear with the native delta, the native SiLU), exactly; TorchLoRA's delta, closely."""
    path = make_checkpoint(tmp_path / "llama", "llama")
    adapters = [
        LoRARequest(name, i + 1, str(make_adapter(path, tmp_path / name, rank, 2 * rank, targets, False, seed=i)))
        for i, (name, rank, targets) in enumerate([("all", 8, ALL), ("mlp", 16, ["gate_proj", "up_proj", "down_proj"])])
    ]
    kwargs = dict(quantization="int8", kv_cache_memory=0.02, max_model_len=256, engine_process=False)
    lora_kwargs = dict(enable_lora=True, max_loras=2, max_lora_rank=16, dtype="float32")
    with_slots: list[bool] = []
    decode_layers = ops.decode_layers

    def counted(*args, **kw):
        with_slots.append(args[7] is not None if len(args) > 7 else kw.get("lora_slots") is not None)
        return decode_layers(*args, **kw)

    monkeypatch.setattr(ops, "decode_layers", counted)
    names = [None, *adapters]

    def run(llm: LLM) -> list:
        return _lora_generate(llm, PROMPTS * len(names), [r for r in names for _ in PROMPTS])

    fused = LLM(str(path), **kwargs, **lora_kwargs)
    got = run(fused)
    assert True in with_slots
    alone = [_lora_generate(fused, [p], [r])[0] for r in names for p in PROMPTS]
    assert got == alone
    with_slots.clear()
    _lora_generate(fused, PROMPTS, [None] * 3)
    assert with_slots and not any(with_slots)  # a step of the base alone passes no slots
    with monkeypatch.context() as m:
        _layer_by_layer(m)
        assert run(LLM(str(path), **kwargs, **lora_kwargs)) == got
    monkeypatch.setattr(registry, "LORA", (lora.TritonLoRA, lora.TorchLoRA))
    with monkeypatch.context() as m:
        _layer_by_layer(m)
        torch_delta = run(LLM(str(path), **kwargs, **lora_kwargs))
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(torch_delta, got, strict=True):
        assert tokens[:12] == ref_tokens[:12]
        torch.testing.assert_close(torch.tensor(logprobs[:12]), torch.tensor(ref_logprobs[:12]), atol=1e-3, rtol=0)


def _lora_generate(llm: LLM, prompts: list[str], loras: list) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]) for o in outs]


def test_bfloat16_slots_end_to_end(tmp_path, monkeypatch) -> None:
    """`lora_dtype="bfloat16"` on the CPU: adapters whose values bfloat16 holds (and a power-of-two scale)
    give the float32 slots' tokens and logprobs exactly, through the native decode layers, the module path
    and the LM head's and embedding's adapters; "auto" is the model's float32. The kernels are handed
    the slots in the dtype asked for."""
    from safetensors.torch import load_file, save_file

    path = make_checkpoint(tmp_path / "llama", "llama")
    adapters = []
    for i, (name, targets) in enumerate([("all", ALL), ("outer", ["embed_tokens", "lm_head", "v_proj"])]):
        out = make_adapter(path, tmp_path / name, 8, 16, targets, False, seed=i)
        file = out / "adapter_model.safetensors"
        save_file({key: t.bfloat16().float() for key, t in load_file(str(file)).items()}, str(file))
        adapters.append(LoRARequest(name, i + 1, str(out)))
    kwargs = dict(quantization="int8", kv_cache_memory=0.02, max_model_len=256, engine_process=False)
    names = [None, *adapters]
    seen: set[torch.dtype] = set()
    flag = ops._lora_bf16
    monkeypatch.setattr(ops, "_lora_bf16", lambda a: seen.add(a.dtype) or flag(a))
    runs = {}
    for dtype in ("auto", "bfloat16"):
        seen.clear()
        llm = LLM(str(path), enable_lora=True, max_loras=2, max_lora_rank=8, lora_dtype=dtype, **kwargs)
        runs[dtype] = _lora_generate(llm, PROMPTS * len(names), [r for r in names for _ in PROMPTS])
        assert seen == {torch.bfloat16 if dtype == "bfloat16" else torch.float32}
    assert runs["bfloat16"] == runs["auto"]
