"""Embeddings from decoder models (docs/pooling.md): Ember's pooled vectors against HF transformers'
(the final norm's hidden states, pooled the same way), batching with generation, chunked prefill,
prefix caching, Matryoshka dimensions, and /v1/embeddings through the `openai` client."""

from __future__ import annotations

import base64
import json
import struct

import numpy as np
import openai
import pytest
import torch
from conftest import make_checkpoint
from test_server import ServerThread, tiny_engine

from ember import LLM, PoolingParams, SamplingParams

LONG = [(7 * i + 3) % 500 + 1 for i in range(90)]  # longer than the token budget: three prefill chunks
PROMPTS = [[5, 9, 13, 2, 77], LONG, [42]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    return {arch: make_checkpoint(root / arch, arch) for arch in ("qwen3", "llama")}


def make_llm(path, max_model_len: int = 128, max_num_batched_tokens: int = 32, **kwargs) -> LLM:
    return LLM(
        str(path),
        device="cpu",
        dtype="float32",
        kv_cache_memory=0.01,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        engine_process=False,
        **kwargs,
    )


def hf_embed(path, ids: list[int], kind: str, dims: int | None = None, normalize: bool = True) -> torch.Tensor:
    import transformers

    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    vec = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind][:dims]
    return torch.nn.functional.normalize(vec, dim=-1) if normalize else vec


def assert_close(got: list[float], ref: torch.Tensor) -> None:
    g = torch.tensor(got)
    assert g.shape == ref.shape
    assert torch.cosine_similarity(g, ref, dim=0).item() >= 0.99999
    assert (g - ref).abs().max().item() < 1e-4


def assert_nothing_held(llm: LLM) -> None:
    stats = llm.llm_engine.scheduler_stats()
    assert stats.num_requests == 0 and stats.kv_cache_usage == 0.0


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_last_token_embeddings_match_hf(ckpts, arch):
    llm = make_llm(ckpts[arch])
    outs = llm.embed(PROMPTS, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == prompt and out.finished
        assert_close(out.outputs.embedding, hf_embed(ckpts[arch], prompt, "LAST"))
    assert_nothing_held(llm)
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_across_chunks_match_hf(ckpts, kind):
    llm = make_llm(ckpts["qwen3"], pooler_config={"pooling_type": kind})
    assert llm.llm_engine.ready.pooling_type == kind
    for _ in range(2):  # the second time its blocks are in the prefix cache: MEAN and CLS take no hits
        outs = llm.embed(PROMPTS, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            assert_close(out.outputs.embedding, hf_embed(ckpts["qwen3"], prompt, kind))
    assert llm.llm_engine.scheduler_stats().prefix_cache_hits == 0
    assert_nothing_held(llm)
    llm.llm_engine.shutdown()


def test_last_token_reuses_the_prefix_cache(ckpts):
    llm = make_llm(ckpts["qwen3"])
    first = llm.embed([LONG], use_tqdm=False)[0].outputs.embedding
    again = llm.embed([LONG], use_tqdm=False)[0].outputs.embedding
    assert llm.llm_engine.scheduler_stats().prefix_cache_hits > 0
    assert np.allclose(first, again, atol=1e-6)
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_dimensions_truncate_then_normalize(ckpts, kind):
    """Whole prompts in one step pool as one batch per Matryoshka cut (ember/runner/pooler.py): each request's
    own cut and normalization still apply, and a prompt chunked over steps (LONG) pools beside them."""
    llm = make_llm(ckpts["qwen3"], pooler_config={"pooling_type": kind})
    params = [
        PoolingParams(dimensions=16),
        PoolingParams(dimensions=16, normalize=False),
        PoolingParams(),
        PoolingParams(normalize=False),
        PoolingParams(dimensions=8),
    ]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[2], LONG]
    outs = llm.embed(prompts, params, use_tqdm=False)
    assert [len(o.outputs.embedding) for o in outs] == [16, 16, 64, 64, 8]
    for prompt, p, out in zip(prompts, params, outs):
        ref = hf_embed(ckpts["qwen3"], prompt, kind, p.dimensions, normalize=p.normalize is not False)
        assert_close(out.outputs.embedding, ref)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed([PROMPTS[0]], PoolingParams(dimensions=65), use_tqdm=False)
    llm.llm_engine.shutdown()


def test_truncate_prompt_tokens_and_too_long_inputs(ckpts):
    llm = make_llm(ckpts["qwen3"])
    out = llm.embed([LONG], PoolingParams(truncate_prompt_tokens=20), use_tqdm=False)[0]
    assert out.prompt_token_ids == LONG[-20:]
    assert_close(out.outputs.embedding, hf_embed(ckpts["qwen3"], LONG[-20:], "LAST"))
    too_long = LONG + LONG
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed([too_long], use_tqdm=False)
    assert (
        llm.embed([too_long], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0].prompt_token_ids
        == (too_long[-128:])
    )
    llm.llm_engine.shutdown()


def test_embed_and_generate_batched_together_match_alone(ckpts):
    llm = make_llm(ckpts["llama"])
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    gen_alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    emb_alone = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    llm.llm_engine.reset_prefix_cache()
    engine = llm.llm_engine
    ids = {}
    for i, prompt in enumerate(PROMPTS):  # interleaved: each step holds both kinds
        ids[engine.add_request(None, prompt, greedy, final_only=True)] = ("gen", i)
        ids[engine.add_request(None, prompt, None, final_only=True, pooling_params=PoolingParams())] = ("emb", i)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[ids[out.request_id]] = out
    for i in range(len(PROMPTS)):
        assert done["gen", i].outputs[0].token_ids == gen_alone[i]
        assert done["gen", i].embedding is None
        assert np.allclose(done["emb", i].embedding, emb_alone[i], atol=1e-5)
        assert done["emb", i].outputs[0].token_ids == []
    assert_nothing_held(llm)
    engine.shutdown()


def test_sentence_transformers_pooling_config_is_detected(ckpts, tmp_path):
    model = tmp_path / "st"
    model.mkdir()
    for f in ckpts["qwen3"].iterdir():
        (model / f.name).symlink_to(f)
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (model / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Transformer"}]))
    llm = make_llm(model)
    assert llm.llm_engine.ready.pooling_type == "MEAN"
    out = llm.embed([PROMPTS[0]], use_tqdm=False)[0]  # no Normalize module: not normalized
    assert_close(out.outputs.embedding, hf_embed(model, PROMPTS[0], "MEAN", normalize=False))
    llm.llm_engine.shutdown()


# ---- /v1/embeddings ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(ckpts):
    with ServerThread(tiny_engine(ckpts["qwen3"], max_model_len=128, max_num_batched_tokens=32)) as s:
        yield s


def test_openai_client_embeddings(server, ckpts):
    client = server.client()
    texts = ["hello world", "an embedding of a longer sentence, one that is surely more than a few tokens"]
    tok = server.state.engine.tokenizer
    base64_default = client.embeddings.create(model="tiny", input=texts)  # the client asks for base64
    floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float", dimensions=32)
    assert [d.index for d in base64_default.data] == [0, 1]
    n_tokens = sum(len(tok.encode(t)) for t in texts)
    assert base64_default.usage.prompt_tokens == base64_default.usage.total_tokens == n_tokens
    for text, full, short in zip(texts, base64_default.data, floats.data):
        ids = tok.encode(text)
        assert_close(full.embedding, hf_embed(ckpts["qwen3"], ids, "LAST"))
        assert_close(short.embedding, hf_embed(ckpts["qwen3"], ids, "LAST", 32))
    by_ids = client.embeddings.create(model="tiny", input=[[5, 9, 13], [42]], encoding_format="float")
    assert_close(by_ids.data[1].embedding, hf_embed(ckpts["qwen3"], [42], "LAST"))
    one = client.embeddings.create(model="tiny", input=[5, 9, 13], encoding_format="float", user="someone")
    assert np.allclose(one.data[0].embedding, by_ids.data[0].embedding, atol=1e-6)


def test_base64_is_little_endian_float32(server):
    body = {"model": "tiny", "input": [5, 9, 13]}
    floats = server.post("/v1/embeddings", {**body, "encoding_format": "float"}).json()
    packed = server.post("/v1/embeddings", {**body, "encoding_format": "base64"}).json()
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    assert floats["model"] == "tiny" and floats["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    raw = base64.b64decode(packed["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert np.allclose(decoded, floats["data"][0]["embedding"], atol=0)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "dimensions": 65}, "dimensions"),
        ({"input": LONG + LONG}, "input"),
        ({"input": [1, 2], "encoding_format": "hex"}, "encoding_format"),
        ({"input": [100000]}, "input"),
    ],
)
def test_bad_embedding_requests_get_400_naming_the_field(server, body, param):
    r = server.post("/v1/embeddings", {"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_bad_request_for_embeddings(server):
    with pytest.raises(openai.BadRequestError):
        server.client().embeddings.create(model="tiny", input="hi", dimensions=1000)
