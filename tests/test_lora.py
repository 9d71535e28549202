"""LoRA adapters: Ember's greedy tokens equal HF PeftModel's (float32) for random PEFT adapters made with
peft, alone and mixed in one batch with the base model; the prefix cache keeps adapters apart; more
adapters than device slots take turns (LRU); bad adapters are refused with a clear error; the Triton
shrink/expand kernels equal the PyTorch reference (through Triton's interpreter on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, KERNEL_DEVICE, inproc_core, make_checkpoint
from safetensors.torch import load_file, save_file

from ember import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):\n    return"]
NUM_TOKENS = 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target modules, use_rslora)
ADAPTERS = {
    "all-r8": (8, 16, ALL, False),
    "qv-r4-rslora": (4, 8, ["q_proj", "v_proj"], True),
    "mlp-r16": (16, 8, ["gate_proj", "up_proj", "down_proj"], False),
    "ko-r2": (2, 4, ["k_proj", "o_proj"], False),
    "embed-head-r4": (4, 8, ["embed_tokens", "lm_head", "v_proj"], False),
}
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def make_adapter(base: Path, out: Path, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int) -> Path:
    """A PEFT LoRA adapter of `base` with random A and B (peft starts B at zero, which would change nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    peft_model.save_pretrained(str(out))
    return out


def hf_greedy(base: Path, adapter: Path | None, prompt_ids: list[list[int]]) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.generation_config.eos_token_id = None
    outs = []
    for ids in prompt_ids:
        t = torch.tensor([ids])
        seq = model.generate(
            input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0
        )
        outs.append(seq[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The base checkpoint, its adapters (name -> LoRARequest) and HF's greedy tokens per adapter (None: base)."""
    root = tmp_path_factory.mktemp("lora")
    base = make_checkpoint(root / "llama", "llama")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    prompt_ids = [tok.encode(p).ids for p in PROMPTS]
    loras, refs = {}, {None: hf_greedy(base, None, prompt_ids)}
    for i, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        path = make_adapter(base, root / name, rank, alpha, targets, rslora, seed=i)
        loras[name] = LoRARequest(name, i + 1, str(path))
        refs[name] = hf_greedy(base, path, prompt_ids)
        assert refs[name] != refs[None], f"adapter {name} changes nothing: the test would prove nothing"
    return base, loras, refs, root


def _llm(base: Path, **kwargs) -> LLM:
    args = dict(kv_cache_memory=0.05, max_model_len=256, device=DEVICE, dtype="float32", engine_process=False)
    return LLM(str(base), enable_lora=True, max_lora_rank=16, **{**args, **kwargs})


def _fuse_shrink(monkeypatch, fused: bool) -> None:
    """Every dense projection's shrink inside its GEMM (`fused`; the tiny model's A is too wide beside W for
    FUSED_SHRINK_MAX_ROWS, lifted here), or none."""
    from ember.model import lora

    monkeypatch.setattr(lora, "FUSED_SHRINK_MAX_ROWS", float("inf") if fused else 0.0)


def _check_fused(llm: LLM, fused: bool) -> None:
    from ember.model.lora import LoRALinear

    wrapped = [m for m in inproc_core(llm).runner.model.modules() if isinstance(m, LoRALinear)]
    assert wrapped and all((m.fused_shrink is not None) == fused for m in wrapped)


@pytest.fixture(
    scope="module",
    params=[False, True] if DEVICE == "cuda" else [False],
    ids=lambda fused: "fused" if fused else "kernels",
)
def llm(setup, request):
    """On a GPU (EMBER_TEST_DEVICE=cuda) twice: with the shrink kernels, and with the shrink inside the
    dense base GEMMs (`_fuse_shrink`); on CPU the native delta, which has its own fusion."""
    with pytest.MonkeyPatch.context() as patch:
        _fuse_shrink(patch, request.param)
        llm = _llm(setup[0], max_loras=len(ADAPTERS))
    _check_fused(llm, request.param)
    return llm


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_each_adapter_and_the_base_match_peft(setup, llm):
    _, loras, refs, _ = setup
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == refs[None]
    for name, lora in loras.items():
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)) == refs[name], name


def test_mixed_batch_equals_each_alone(setup, llm):
    """5 adapters (one with embed_tokens and lm_head) and the base, every prompt under each, in one generate
    call (one batch per step)."""
    _, loras, refs, _ = setup
    names = [None, *loras]
    prompts = [p for _ in names for p in PROMPTS]
    per_prompt = [None if n is None else loras[n] for n in names for _ in PROMPTS]
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt))
    assert got == [t for n in names for t in refs[n]]


def test_prefix_cache_keeps_adapters_apart(setup):
    """The same long prompt under the base and two adapters, one after another with prefix caching on:
    each gets its own result, and only a repeat under the same adapter hits the cache."""
    base, loras, _, _ = setup
    llm = _llm(base, max_loras=1)
    prompt = "Large language models generate text one token at a time. " * 4
    runs = [None, loras["all-r8"], loras["qv-r4-rslora"], loras["all-r8"]]
    outs = [llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0] for lora in runs]
    assert [o.num_cached_tokens for o in outs[:3]] == [0, 0, 0]
    assert outs[3].num_cached_tokens > 0 and outs[3].outputs[0].token_ids == outs[1].outputs[0].token_ids
    tokens = [o.outputs[0].token_ids for o in outs[:3]]
    assert tokens[0] != tokens[1] and tokens[1] != tokens[2]
    fresh = _llm(base, max_loras=1, enable_prefix_caching=False)
    for lora, out in zip(runs[1:3], outs[1:3]):
        alone = fresh.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)
        assert _tokens(alone) == [out.outputs[0].token_ids]


def test_more_adapters_than_slots_take_turns(setup):
    """max_loras=2 with 4 adapters in one call: requests wait for a slot, adapters are evicted LRU and read
    again (max_cpu_loras=2 drops host copies too), and every output still equals peft's."""
    base, loras, refs, _ = setup
    llm = _llm(base, max_loras=2, max_cpu_loras=2)
    names = list(loras)
    prompts = [p for _ in names for p in PROMPTS]
    per_prompt = [loras[n] for n in names for _ in PROMPTS]
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)) == [
        t for n in names for t in refs[n]
    ]
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras["all-r8"])) == refs["all-r8"]


def test_engine_process(setup):
    base, loras, refs, _ = setup
    llm = _llm(base, max_loras=2, engine_process=True)
    lora = loras["qv-r4-rslora"]
    got = _tokens(llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False, lora_request=[lora] * 3 + [None] * 3))
    assert got == refs["qv-r4-rslora"] + refs[None]


def _broken(root: Path, good: Path, name: str, config: dict | None = None, tensors=None) -> LoRARequest:
    """A copy of the adapter `good` with its config fields replaced and its tensors transformed."""
    out = root / "broken" / name
    out.mkdir(parents=True)
    cfg = json.loads((good / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    weights = load_file(str(good / "adapter_model.safetensors"))
    save_file(tensors(weights) if tensors else weights, str(out / "adapter_model.safetensors"))
    return LoRARequest(name, 100 + len(name), str(out))


def test_bad_adapters_are_refused(setup, llm, tmp_path):
    """Each bad adapter is refused with a ValueError naming what is wrong, and the engine serves on; the broken
    copies go to tmp_path, as `setup` is shared by both `llm` parameters."""
    base, loras, refs, root = setup
    good = Path(loras["all-r8"].lora_path)

    def refused(lora: LoRARequest, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=lora)

    refused(LoRARequest("gone", 90, str(root / "nowhere")), "no such directory")
    missing = tmp_path / "broken" / "empty"
    missing.mkdir(parents=True)
    (missing / "adapter_config.json").write_text("{}")
    refused(LoRARequest("empty", 91, str(missing)), "missing adapter_model.safetensors")
    refused(_broken(tmp_path, good, "rank", {"r": 32}), "rank 32 is larger than max_lora_rank")
    refused(_broken(tmp_path, good, "bias", {"bias": "all"}), "bias")
    refused(
        _broken(tmp_path, good, "save", {"modules_to_save": ["lm_head"]}), "modules_to_save: whole replaced modules"
    )
    refused(_broken(tmp_path, good, "unknown", {"target_modules": ["wte", "q_proj"]}), "'wte' cannot be mapped")
    refused(_broken(tmp_path, good, "dora", {"use_dora": True}), "use_dora")

    def widen(w: dict) -> dict:
        return {k: torch.zeros(v.shape[0], v.shape[1] + 1) if "q_proj.lora_A" in k else v for k, v in w.items()}

    refused(_broken(tmp_path, good, "shape", tensors=widen), r"lora_A.weight' has shape \[8, 65\], expected \[8, 64\]")

    def lm_head(w: dict) -> dict:
        return {**w, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}

    refused(_broken(tmp_path, good, "head", tensors=lm_head), "lm_head has no lora_B tensor")

    def more_tokens(w: dict) -> dict:  # PEFT's added tokens: every vocabulary axis one longer
        axis = {"lora_embedding_A": 1, "lm_head.lora_B": 0, "base_layer": 0}
        grow = {k: next((a for key, a in axis.items() if key in k), None) for k in w}
        return {k: v if grow[k] is None else torch.cat([v, v.narrow(grow[k], 0, 1)], grow[k]) for k, v in w.items()}

    embed_head = Path(loras["embed-head-r4"].lora_path)
    refused(_broken(tmp_path, embed_head, "vocab", tensors=more_tokens), "added tokens are not supported")
    refused(LoRARequest("zero", 0, str(good)), "lora_int_id must be an integer >= 1")
    # the engine serves on, the good adapters unchanged
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras["all-r8"])) == refs["all-r8"]


def test_lora_needs_enable_lora(setup):
    base, loras, _, _ = setup
    llm = LLM(str(base), kv_cache_memory=0.05, max_model_len=256, device=DEVICE, dtype="float32", engine_process=False)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=loras["all-r8"])


def test_lora_dtype_is_checked():
    """`lora_dtype` takes "auto" or a dtype name (the flag's value is checked where it is given); a dtype
    other than the model's runs on the CPU only, a ValueError naming the field elsewhere."""
    from ember.config import EngineArgs
    from ember.model.lora import slot_dtype
    from ember.ops.target import Target

    with pytest.raises(ValueError, match="lora_dtype must be 'auto' or one of"):
        EngineArgs(model="m", enable_lora=True, lora_dtype="int8")
    assert EngineArgs(model="m", enable_lora=True, lora_dtype="bf16").lora_config().lora_dtype == "bfloat16"
    cpu = Target(torch.device("cpu"), torch.float32, False, True)
    assert slot_dtype("auto", cpu) == torch.float32 and slot_dtype("bfloat16", cpu) == torch.bfloat16
    cuda = Target(torch.device("cuda"), torch.bfloat16, True, False)
    assert slot_dtype("auto", cuda) == slot_dtype("bfloat16", cuda) == torch.bfloat16
    with pytest.raises(ValueError, match=r"lora_dtype: adapters on cuda run in the model's dtype"):
        slot_dtype("float32", cuda)


def test_quantized_base_takes_adapters(setup):
    """The delta is added to the base projection's output: an int8 base with an adapter equals the int8 base
    plus what the adapter adds to a float base, so its tokens differ from the int8 base's alone."""
    base, loras, refs, _ = setup
    llm = _llm(base, max_loras=1, quantization="int8")
    plain = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    adapted = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras["all-r8"]))
    assert adapted != plain
    assert sum(a[:4] == r[:4] for a, r in zip(adapted, refs["all-r8"])) >= 2  # int8 rounding may move late tokens


def test_qwen3_adapter_matches_peft(tmp_path):
    base = make_checkpoint(tmp_path / "qwen3", "qwen3")
    adapter = make_adapter(base, tmp_path / "adapter", 8, 16, ALL, False, seed=7)
    from tokenizers import Tokenizer

    ids = [Tokenizer.from_file(str(base / "tokenizer.json")).encode(p).ids for p in PROMPTS]
    llm = _llm(base, max_loras=1)
    lora = LoRARequest("q", 1, str(adapter))
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)) == hf_greedy(base, adapter, ids)


@pytest.mark.parametrize("widths", [[48, 16, 16], [40]])
def test_triton_kernels_match_reference(widths):
    """Shrink then one expand for every slice, rows under 3 slots and none, against the float64 reference;
    the PyTorch implementation (the CPU path) against the same."""
    from ember.kernels.lora import lora_expand, lora_ref, lora_shrink
    from ember.ops.lora import LoRAWeights, TorchLoRA, stacked_slices

    gen = torch.Generator().manual_seed(0)
    slots_n, rank, k, rows = 3, 8, 40, 7
    a = torch.randn(slots_n, len(widths) * rank, k, generator=gen)
    b = stacked_slices(slots_n, rank, widths, torch.float32, KERNEL_DEVICE)
    for bi in b:
        bi.copy_(torch.randn(bi.shape, generator=gen))
    x = torch.randn(rows, k, generator=gen)
    slots = torch.tensor([0, -1, 2, 1, 2, -1, 0], dtype=torch.int32)
    base = torch.randn(rows, sum(widths), generator=gen)
    a, x, slots, base = (t.to(KERNEL_DEVICE) for t in (a, x, slots, base))
    want = base.double() + lora_ref(x, a, b, slots)
    y = base.clone()
    lora_expand(lora_shrink(x, a, slots), b, slots, y)
    torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-5)
    y = base.clone()
    TorchLoRA()(x, y, LoRAWeights(a, b, [sum(widths[:i]) for i in range(len(widths))]), slots)
    torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-5)


def test_embedding_delta_matches_reference():
    """An embedding adapter's delta, B[s] @ A[s][:, id] per row (slot -1: none), by both implementations."""
    from ember.ops.lora import LoRAWeights, TorchLoRA, TritonLoRA

    gen = torch.Generator().manual_seed(1)
    slots_n, rank, vocab, hidden = 3, 4, 50, 24
    w = LoRAWeights(
        torch.randn(slots_n, rank, vocab, generator=gen), [torch.randn(slots_n, rank, hidden, generator=gen)], [0]
    )
    ids = torch.tensor([3, 49, 0, 7, 3, 11])
    slots = torch.tensor([0, -1, 2, 1, 2, -1], dtype=torch.int32)
    base = torch.randn(len(ids), hidden, generator=gen)
    w = LoRAWeights(w.a.to(KERNEL_DEVICE), [w.b[0].to(KERNEL_DEVICE)], [0])
    ids, slots, base = ids.to(KERNEL_DEVICE), slots.to(KERNEL_DEVICE), base.to(KERNEL_DEVICE)
    want = base.double().clone()
    for t, (v, s) in enumerate(zip(ids.tolist(), slots.tolist())):
        if s >= 0:
            want[t] += w.a[s, :, v].double() @ w.b[0][s].double()
    for impl in (TorchLoRA(), TritonLoRA()):
        y = base.clone()
        impl.embed(ids, y, w, slots)
        torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-5)


def test_fused_shrink_where_it_applies(monkeypatch):
    """A dense nn.Linear under the Triton path: its weight and bias moved to the head of the stacked buffer,
    the same values, so the module computes as before (steps of the base alone); none on the CPU's own
    paths, for a quantized base, or where A's rows pass FUSED_SHRINK_MAX_ROWS of W's."""
    from ember.model.linear import quantize_module
    from ember.model.lora import FUSED_SHRINK_MAX_ROWS, _fused_shrink
    from ember.ops import registry

    def linear() -> torch.nn.Linear:
        torch.manual_seed(0)
        return torch.nn.Linear(32, 64, bias=True)

    x = torch.randn(5, 32)
    assert _fused_shrink(linear(), 8) is None  # the CPU's native / PyTorch delta
    monkeypatch.setattr(registry, "FORCE_TRITON", True)
    base = linear()
    want = base(x)
    fused = _fused_shrink(base, 8)
    assert fused is not None and base.weight.data_ptr() == fused.weight.data_ptr()
    assert fused.weight.shape == (64 + 8, 32) and fused.a(2).shape == (2, 4, 32) and not fused.a(2).any()
    assert torch.equal(base(x), want)
    assert _fused_shrink(linear(), int(64 * FUSED_SHRINK_MAX_ROWS) + 1) is None
    assert _fused_shrink(quantize_module(linear(), "int8", torch.float32, tied=False), 8) is None


@pytest.mark.parametrize("fused", [False, True])
def test_triton_path_mixed_batch(setup, monkeypatch, fused: bool):
    """The whole GPU code path (registry.FORCE_TRITON: Triton kernels through the interpreter, the LoRA
    delta by the shrink/expand kernels, or, `fused`, the shrink inside the dense base's GEMM and the expand
    alone) with two adapters (one adapting embed_tokens and lm_head) and the base in one batch."""
    from ember.ops import registry

    base, loras, refs, _ = setup
    monkeypatch.setattr(registry, "FORCE_TRITON", True)
    _fuse_shrink(monkeypatch, fused)
    llm = _llm(base, max_loras=2)
    _check_fused(llm, fused)
    names = [None, "all-r8", "embed-head-r4"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    per_prompt = [None if n is None else loras[n] for n in names for _ in PROMPTS]
    got = _tokens(llm.generate(PROMPTS * len(names), params, use_tqdm=False, lora_request=per_prompt))
    assert got == [t[:6] for n in names for t in refs[n]]


def test_step_inputs_carry_each_tokens_slot():
    """prepare_step writes each token's adapter slot, decodes first and in slot order (the LoRA kernels' row
    tiles then mostly hold one adapter), and -1 for the base and for the pad rows of a CUDA graph (host side:
    the buffer the LoRA layers read)."""
    import numpy as np

    from ember.runner.input_buffers import InputBuffers
    from ember.runner.request_state import RequestState
    from ember.runner.step_inputs import GraphSizes, prepare_step

    def request(name: str, prompt_len: int, lora: LoRARequest | None, computed: int = 0) -> RequestState:
        r = RequestState(name, list(range(3, 3 + prompt_len)), GREEDY, [0], lora_request=lora)
        r.block_ids, r.num_computed_tokens = [0, 1, 2, 3], computed
        return r

    a, b = LoRARequest("a", 7, "/a"), LoRARequest("b", 9, "/b")
    buffers = InputBuffers(64, 8, 16, torch.device("cpu"), lora=True)
    assert buffers.lora_slots is not None
    buffers.lora_slots.np[:] = 99  # stale values from an earlier step
    reqs = [request("p", 5, b), request("d1", 5, a, computed=5), request("d2", 5, None, computed=5)]
    for r in reqs[1:]:
        r.token_ids.append(1)
    prepare_step(reqs, [5, 1, 1], buffers, 4, None, {7: 0, 9: 3})
    np.testing.assert_array_equal(buffers.lora_slots.np[:7], [-1, 0, 3, 3, 3, 3, 3])  # decodes, then the prompt
    assert buffers.input_ids.np[:2].tolist() == [1, 1] and buffers.positions.np[:2].tolist() == [5, 5]
    decodes = reqs[1:]
    header = prepare_step(decodes, [1, 1], buffers, 4, GraphSizes(decode=(4,)), {7: 1}).header
    assert header.padded == 4
    np.testing.assert_array_equal(buffers.lora_slots.np[:4], [-1, 1, -1, -1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_graphs_with_and_without_the_lora_kernels(setup, monkeypatch, fused: bool):
    """CUDA graphs on: steps of the base alone replay the graphs captured without the LoRA kernels, steps with
    an adapter (decodes of two adapters, one adapting embed_tokens and lm_head, beside the base; a lone
    prompt's prefill graph) only those with them; the greedy tokens of the base alone, then adapters, then
    the base alone again equal enforce_eager's; with the shrink kernels or inside the base GEMMs (`fused`)."""
    base, loras, _, _ = setup
    _fuse_shrink(monkeypatch, fused)
    phases = [
        [None] * 3,
        [loras["all-r8"], None, loras["embed-head-r4"]],
        [loras["embed-head-r4"]],
        [None] * 3,
    ]

    def run(llm: LLM, lora: list[LoRARequest | None]) -> list[list[int]]:
        return _tokens(llm.generate(PROMPTS[: len(lora)], GREEDY, use_tqdm=False, lora_request=lora))

    eager = _llm(base, device="cuda", max_loras=2, max_num_seqs=8, enforce_eager=True)
    want = [run(eager, lora) for lora in phases]
    assert want[1][0] != want[0][0] and want[1][2] != want[0][2], "the adapters change nothing"
    eager.llm_engine.shutdown()
    llm = _llm(base, device="cuda", max_loras=2, max_num_seqs=8)
    _check_fused(llm, fused)
    graphs = inproc_core(llm).runner.graphs
    replay, replayed = graphs.replay, []
    monkeypatch.setattr(graphs, "replay", lambda key: replayed.append(key) or replay(key))
    keys = []
    for lora, tokens in zip(phases, want):
        replayed.clear()
        assert run(llm, lora) == tokens
        keys.append(list(replayed))
        assert replayed and {key.lora for key in replayed} == {any(r is not None for r in lora)}
    assert any(key.prefill for key in keys[2])  # the lone prompt's chunk


def test_async_scheduling_and_chunked_prefill(setup):
    """The host preparing step N+1 (adapters put in slots) before step N is collected, and prompts cut into
    chunks beside decodes: the mixed batch still equals each adapter alone."""
    base, loras, refs, _ = setup
    llm = _llm(base, max_loras=4, async_scheduling=True, max_num_batched_tokens=8)
    names = [None, *loras]
    per_prompt = [None if n is None else loras[n] for n in names for _ in PROMPTS]
    got = _tokens(llm.generate(PROMPTS * len(names), GREEDY, use_tqdm=False, lora_request=per_prompt))
    assert got == [t for n in names for t in refs[n]]


def test_embedding_and_lm_head_adapter_on_a_tied_base(tmp_path):
    """A base whose LM head is its embedding, and an adapter on both (separate LoRA pairs, as PEFT makes
    them): greedy tokens and top logprobs as PeftModel's, prompt logprobs too, and alone equal to a batch
    beside the base."""
    from peft import PeftModel
    from test_hf_equality import TOP, assert_output_matches
    from test_hf_equality import hf_greedy as hf_scores
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    base = make_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True)
    adapter = make_adapter(base, tmp_path / "adapter", 8, 16, ["embed_tokens", "lm_head", "q_proj"], True, seed=5)
    ids = [Tokenizer.from_file(str(base / "tokenizer.json")).encode(p).ids for p in PROMPTS]
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), str(adapter))
    refs = [hf_scores(hf, p, NUM_TOKENS) for p in ids]
    llm, lora = _llm(base, max_loras=1), LoRARequest("tied", 1, str(adapter))
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP, prompt_logprobs=1)
    outs = llm.generate(PROMPTS + PROMPTS[:1], params, use_tqdm=False, lora_request=[lora] * 3 + [None])
    for prompt, p_ids, out, ref in zip(PROMPTS, ids, outs, refs):
        assert_output_matches(out.outputs[0], *ref, prompt)
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([p_ids])).logits[0].float(), dim=-1)
        for pos in range(1, len(p_ids)):
            got = out.prompt_logprobs[pos][p_ids[pos]].logprob
            assert got == pytest.approx(want[pos - 1, p_ids[pos]].item(), abs=2e-3)
    assert _tokens(outs[3:]) != [refs[0][0]]  # the base's own tokens: the adapter changes them
    alone = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=lora)
    assert _tokens(alone) == [refs[0][0]]
