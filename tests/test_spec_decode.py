"""Speculative decoding is exact: under greedy decoding every method (n-gram lookup, a draft model) gives
the tokens of plain decoding, token for token in float32, also with chunked prefill, prefix caching,
preemption, logprobs, penalties, stop tokens and structured output; drafts are counted and budgeted,
rejected drafts' blocks go back, and bad configurations are refused with the field named."""

from __future__ import annotations

import random
import re

import pytest
from conftest import DEVICE, inproc_core, make_checkpoint

from ember import LLM, SamplingParams
from ember.config import EngineArgs
from ember.sampling.structured import StructuredOutputsParams

# drafts for every running request (the CPU's default budget turns them off beyond a couple of requests)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "draft_token_budget": 1024,
}
ENGINE = dict(device=DEVICE, dtype="float32", kv_cache_memory=0.05)


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    """Random prompts, half of them repeating a phrase, so that n-gram drafts are both accepted and rejected."""
    rng = random.Random(3)
    out = []
    for i in range(12):
        phrase = [rng.randint(5, 511) for _ in range(rng.randint(3, 12))]
        tail = [rng.randint(5, 511) for _ in range(rng.randint(1, 40))]
        out.append({"prompt_token_ids": (phrase * 4 + tail) if i % 2 else tail + phrase})
    return out


@pytest.fixture(scope="module")
def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def plain(llama_dir, prompts, greedy):
    return LLM(str(llama_dir), **ENGINE).generate(prompts, greedy, use_tqdm=False)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """A different model of the same vocabulary: its drafts are often wrong."""
    return str(make_checkpoint(tmp_path_factory.mktemp("draft") / "llama", "llama", num_hidden_layers=1))


def _assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert lg.keys() == lw.keys()
            for t in lg:
                assert lg[t].logprob == pytest.approx(lw[t].logprob, abs=1e-4)


def _spec_config(kind: str, llama_dir, other_draft) -> dict:
    if kind == "ngram":
        return NGRAM
    model = str(llama_dir) if kind == "draft-same" else other_draft
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 4, "draft_token_budget": 1024}


@pytest.mark.parametrize("kind", ["ngram", "draft-same", "draft-other"])
def test_greedy_is_exact(llama_dir, other_draft, prompts, greedy, plain, kind):
    llm = LLM(str(llama_dir), **ENGINE, speculative_config=_spec_config(kind, llama_dir, other_draft))
    got = llm.generate(prompts, greedy, use_tqdm=False)
    _assert_same(got, plain)
    drafted = sum(o.metrics.num_draft_tokens for o in got)
    accepted = sum(o.metrics.num_accepted_tokens for o in got)
    assert drafted > 0 and accepted > 0
    if kind == "draft-same":  # the target as its own draft model: every draft is the target's choice
        assert accepted == drafted
    else:
        assert accepted < drafted
    spec = llm.llm_engine.scheduler_stats().spec_decode
    assert spec is not None and spec.num_draft_tokens == drafted and spec.num_accepted_tokens == accepted
    assert sum(spec.num_accepted_tokens_per_pos) == accepted
    assert spec.num_accepted_tokens_per_pos == sorted(spec.num_accepted_tokens_per_pos, reverse=True)


@pytest.mark.parametrize("kind", ["ngram", "draft-other"])
def test_exact_with_chunked_prefill_preemption_and_prefix_cache(llama_dir, other_draft, prompts, greedy, plain, kind):
    """24 blocks of 16 tokens hold ~3 sequences: requests are preempted and recomputed, and prompts are
    cut into 24-token chunks; a second round finds its prompts in the prefix cache. Every block is free
    at the end."""
    bm_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K+V, layers, block, kv heads, head_dim, fp32
    if kind != "ngram":
        bm_bytes += 2 * 1 * 16 * 2 * 16 * 4  # the one-layer draft model's KV for the same blocks
    llm = LLM(
        str(llama_dir),
        device=DEVICE,
        dtype="float32",
        kv_cache_memory=24 * bm_bytes / 2**30,
        max_model_len=256,
        max_num_batched_tokens=24,
        speculative_config=_spec_config(kind, llama_dir, other_draft),
    )
    assert llm.llm_engine.ready.num_blocks == 24
    _assert_same(llm.generate(prompts, greedy, use_tqdm=False), plain)
    assert llm.llm_engine.scheduler_stats().num_preemptions > 0
    _assert_same(llm.generate(prompts[:3], greedy, use_tqdm=False), plain[:3])
    stats = llm.llm_engine.scheduler_stats()
    assert stats.prefix_cache_hits > 0 and stats.kv_cache_usage == 0.0
    assert stats.spec_decode is not None and stats.spec_decode.num_draft_tokens > 0


def test_penalties_stop_tokens_and_min_tokens(llama_dir, prompts):
    """Rows after drafts count the drafts as output: penalties, min_tokens and stops see the same
    history as in plain decoding."""
    params = [
        SamplingParams(temperature=0, max_tokens=30, presence_penalty=0.7, frequency_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, min_tokens=10),
    ]
    reference = LLM(str(llama_dir), **ENGINE)
    plain = reference.generate(prompts, params * 6, use_tqdm=False)
    # the token plain greedy decoding emits at position 12 becomes a stop token: the output ends there
    free = reference.generate(prompts[1:2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    stop = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[free[0].outputs[0].token_ids[12]]
    )
    plain_stop = reference.generate(prompts[1:2], stop, use_tqdm=False)
    llm = LLM(str(llama_dir), **ENGINE, speculative_config=NGRAM)
    got = llm.generate(prompts, params * 6, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    got_stop = llm.generate(prompts[1:2], stop, use_tqdm=False)[0].outputs[0]
    assert got_stop.token_ids == plain_stop[0].outputs[0].token_ids
    assert got_stop.finish_reason == "stop" and len(got_stop.token_ids) <= 13


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_structured_output_under_speculation(llama_dir, prompts, temperature):
    """Drafts are cut to what the grammar allows, each verified row gets its mask after the drafts
    before it, and the matcher ends where the emitted tokens leave it: greedy output is plain decoding's,
    and sampled output always matches the grammar."""
    params = SamplingParams(
        temperature=temperature,
        max_tokens=40,
        seed=1,
        structured_outputs=StructuredOutputsParams(regex=r"(ab|cd|abcd){3,12}e"),
    )
    llm = LLM(str(llama_dir), **ENGINE, speculative_config=NGRAM)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0
    for o in got:
        assert re.fullmatch(r"(ab|cd|abcd){3,12}e", o.outputs[0].text), o.outputs[0].text
    if temperature == 0.0:
        want = LLM(str(llama_dir), **ENGINE).generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]


@pytest.mark.parametrize("kind", ["ngram", "draft-other"])
def test_async_scheduling_overlaps_steps_while_drafts_are_off(llama_dir, other_draft, prompts, kind):
    """With async scheduling, steps overlap while the batch is too large for drafts (12 requests, a
    budget of 6) and go one at a time once requests finish and drafts come back: the same tokens."""
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    want = LLM(str(llama_dir), **ENGINE).generate(prompts, params, use_tqdm=False)
    config = {**_spec_config(kind, llama_dir, other_draft), "draft_token_budget": 6}
    llm = LLM(str(llama_dir), **ENGINE, async_scheduling=True, speculative_config=config)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert sum(o.metrics.num_draft_tokens for o in got) > 0
    assert llm.llm_engine.ready.async_scheduling


def test_draft_budget_turns_speculation_down(llama_dir):
    """`draft_token_budget` drafts a step at most: 3 per request alone, none for 9 running requests."""
    config = {**NGRAM, "draft_token_budget": 8}
    llm = LLM(str(llama_dir), **ENGINE, speculative_config=config, engine_process=False)
    scheduler = inproc_core(llm).scheduler
    assert scheduler.num_draft_tokens() == 3
    repeat = {"prompt_token_ids": [7, 8, 9] * 10}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate([repeat] * 9, params, use_tqdm=False)
    assert sum(o.metrics.num_draft_tokens for o in out) == 0
    for running, drafts in ((2, 3), (4, 2), (8, 1), (9, 0)):  # how the rule scales
        scheduler.running = [None] * running  # type: ignore[list-item]
        assert scheduler.num_draft_tokens() == drafts
    scheduler.running = []


def test_rejected_drafts_give_their_blocks_back(llama_dir):
    """Block size 2 and 3 drafts: a rejected draft's slots often fill a block of their own, which is
    released at once (the request's table shrinks) and nothing leaks by the end."""
    llm = LLM(str(llama_dir), **ENGINE, block_size=2, speculative_config=NGRAM, engine_process=False)
    core = inproc_core(llm)
    trims = []
    original = core.block_manager.trim

    def counting(request, num_tokens):
        kept = original(request, num_tokens)
        trims.append(kept)
        return kept

    core.block_manager.trim = counting
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randint(5, 511) for _ in range(30)]} for _ in range(6)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert any(k is not None for k in trims)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


@pytest.mark.parametrize(
    "config,field",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tokens": 3}, "draft_tokens"),
        ('{"method": "ngram", ', "JSON"),
    ],
)
def test_bad_configs_name_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(speculative_config=config)


def test_draft_model_vocabulary_must_match(llama_dir, tmp_path):
    other = make_checkpoint(tmp_path / "small-vocab", "llama", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(
            str(llama_dir),
            **ENGINE,
            speculative_config={"method": "draft_model", "model": str(other), "num_speculative_tokens": 2},
        )


# --- EAGLE-3 ----------------------------------------------------------------------------------------

EAGLE_LAYERS = [0, 1, 3]  # of the 4-layer target below
EAGLE_VOCAB = 128  # the head's draft vocabulary: a scattered quarter of the target's 512 tokens


@pytest.fixture(scope="module")
def eagle_target(tmp_path_factory) -> str:
    return str(make_checkpoint(tmp_path_factory.mktemp("target4") / "llama", "llama", num_hidden_layers=4))


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory) -> str:
    """A random EAGLE-3 head for the 64-wide target, in SpecForge's layout (the target's embedding shared)."""
    import json

    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)
    hidden, heads, kv_heads, head_dim, inter, vocab = 64, 4, 2, 16, 128, 512

    def rand(*shape: int, std: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    ids = torch.randperm(vocab, generator=g)[:EAGLE_VOCAB].sort().values
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(EAGLE_VOCAB, hidden, std=0.5),
        "d2t": ids - torch.arange(EAGLE_VOCAB),
    }
    path = tmp_path_factory.mktemp("eagle")
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024,
        "vocab_size": vocab,
        "draft_vocab_size": EAGLE_VOCAB,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": EAGLE_LAYERS},
    }
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def _eagle(head: str, **extra) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "draft_token_budget": 1024, **extra}


def test_eagle3_greedy_is_exact(eagle_target, eagle_head, prompts, greedy):
    plain = LLM(eagle_target, **ENGINE).generate(prompts, greedy, use_tqdm=False)
    llm = LLM(eagle_target, **ENGINE, max_num_batched_tokens=48, speculative_config=_eagle(eagle_head))
    got = llm.generate(prompts, greedy, use_tqdm=False)
    _assert_same(got, plain)
    assert sum(o.metrics.num_draft_tokens for o in got) > 0
    assert llm.llm_engine.scheduler_stats().kv_cache_usage == 0.0


def test_eagle3_drafts_are_the_heads_predictions(eagle_target, eagle_head):
    """After a prompt's step, the request's drafts are what the head predicts from the target's features
    over the whole sequence, computed again here from scratch: the first from the target's layers 0, 1
    and 3 at the prompt's last position and the sampled token, the next from the head's own state."""
    import torch

    from ember.config import LoadConfig
    from ember.messages import EngineCoreRequest
    from ember.model.eagle3 import load_eagle3
    from ember.model.loader import load_model_files
    from ember.ops.attention import AttentionMetadata
    from ember.runner.kv_cache import KVCache
    from ember.runner.model_build import build_model

    llm = LLM(eagle_target, **ENGINE, speculative_config=_eagle(eagle_head), engine_process=False)
    core = inproc_core(llm)
    prompt = [random.Random(9).randint(5, 511) for _ in range(21)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    core.add_request(EngineCoreRequest("r", prompt, params, 8, [2], 0.0))
    sampled = core.step().outputs[0].new_token_ids
    drafts = core.requests["r"].spec_token_ids
    assert len(sampled) == 1 and len(drafts) == 3

    cpu, n = torch.device("cpu"), len(prompt)
    files = load_model_files(LoadConfig(eagle_target, None, "auto", None))
    target = build_model(files, files.model_config, 64, torch.float32, cpu, 0)
    target.set_aux_hidden_state_layers(tuple(EAGLE_LAYERS))
    head = load_eagle3(eagle_head, files.model_config, cpu, torch.float32)
    head.share_embedding(target.model.embed_tokens)
    for layers in (target.attention_layers(), head.attention_layers()):
        kv_heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
        KVCache(layers, kv_heads, head_dim, 16, torch.float32, cpu).allocate(4)

    def meta(start: int, count: int) -> AttentionMetadata:
        end = start + count
        return AttentionMetadata(
            slot_mapping=torch.arange(start, end),
            block_tables=torch.tensor([[0, 1, 2, 3]], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            query_start_loc=torch.tensor([0, count], dtype=torch.int32),
            num_decodes=int(count == 1),
            max_query_len=0 if count == 1 else count,
            max_seq_len=end,
            seq_lens_host=[end],
            query_start_host=[0, count],
        )

    with torch.inference_mode():
        target(torch.tensor(prompt), torch.arange(n), meta(0, n))
        aux = target.aux_hidden_states
        shifted = torch.tensor(prompt[1:] + sampled)
        h_normed, h_prenorm = head(shifted, torch.arange(n), aux, meta(0, n))
        want = [int(head.draft_tokens(h_normed[-1:])[0])]
        hidden = h_prenorm[-1:]
        for j in range(2):
            h_normed, hidden = head(torch.tensor(want[-1:]), torch.tensor([n + j]), hidden, meta(n + j, 1))
            want.append(int(head.draft_tokens(h_normed)[0]))
    assert drafts == want


def test_a_verify_step_is_a_decode_batch(llama_dir):
    """Each draft is a one-token query of its own (decode graphs, the CPU's decode kernels): the step
    that verifies 3 drafts of one request has 4 decode rows, sampled at every row."""
    from ember.runner import step_inputs

    llm = LLM(str(llama_dir), **ENGINE, speculative_config=NGRAM, engine_process=False)
    steps = []
    prepare = step_inputs.prepare_step

    def recording(*args, **kwargs):
        prepared = prepare(*args, **kwargs)
        steps.append(prepared.header)
        return prepared

    from ember.runner import model_runner

    model_runner.prepare_step = recording
    try:
        repeat = {"prompt_token_ids": [7, 8, 9, 10] * 8}
        out = llm.generate([repeat], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        model_runner.prepare_step = prepare
    assert out[0].metrics.num_draft_tokens > 0
    verify = [h for h in steps if h.num_sample > 1]
    assert verify and all(h.num_decodes == h.num_seqs == h.num_tokens == h.num_sample for h in verify)


def test_yaml_config_takes_a_mapping(tmp_path):
    """`speculative-config:` in `ember serve --config` YAML is a mapping, parsed like the JSON flag."""
    import argparse

    from ember.server.args import add_serve_args, resolve_args, settings_from_args

    path = tmp_path / "serve.yaml"
    path.write_text("speculative-config:\n  method: ngram\n  num_speculative_tokens: 3\n  prompt_lookup_max: 4\n")
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    engine, _ = settings_from_args(resolve_args(parser.parse_args(["--config", str(path)])))
    spec = engine.engine_config().speculative
    assert spec is not None and (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 4)


def test_stop_strings_inside_accepted_drafts(llama_dir, prompts, plain):
    """A stop string the front end finds in the middle of a step's several tokens ends the text there,
    as in plain decoding."""
    text = plain[1].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    want = LLM(str(llama_dir), **ENGINE).generate(prompts, params, use_tqdm=False)
    got = LLM(str(llama_dir), **ENGINE, speculative_config=NGRAM).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    assert got[1].outputs[0].finish_reason == "stop" and stop not in got[1].outputs[0].text
