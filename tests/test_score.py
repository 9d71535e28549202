"""Decoder rerankers (docs/pooling.md, "Scores"): Ember's P(yes) of Qwen3-Reranker's prompt against HF
transformers' (AutoModelForCausalLM, float32, softmax of the yes/no logits at the last position),
`LLM.score`'s pairings, and /v1/score, /v1/rerank and /rerank through httpx."""

from __future__ import annotations

import httpx
import pytest
import torch
from conftest import make_checkpoint
from test_pooling import make_llm as make_pooling_llm
from test_server import ServerThread, tiny_engine

from ember import LLM, PoolingParams, SamplingParams, ScoreConfig

QUERY = "what is the capital of France?"
DOCS = [
    "Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b): return a + b",
]


def _add_yes_no(path) -> None:
    """The tiny tokenizer learns no "yes" / "no": add them as tokens (ids 436, 437, inside the model's 512)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens(["yes", "no"])
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("score")
    paths = {
        "untied": make_checkpoint(root / "untied", "qwen3"),
        "tied": make_checkpoint(root / "tied", "qwen3", tie_word_embeddings=True),
    }
    for path in paths.values():
        _add_yes_no(path)
    return paths


def make_llm(path, **kwargs) -> LLM:
    """test_pooling's engine, with room for the prompts (~90 tokens, two prefill chunks)."""
    return make_pooling_llm(path, max_model_len=256, max_num_batched_tokens=64, **kwargs)


def hf_scores(path, pairs, instruction=None, yes_no=("yes", "no")) -> tuple[list[float], list[list[int]]]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids_yes, ids_no = (t if isinstance(t, int) else tok.convert_tokens_to_ids(t) for t in yes_no)
    config = ScoreConfig()
    scores, prompts = [], []
    for query, doc in pairs:
        ids = tok(config.prompt(query, doc, instruction))["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        scores.append(torch.softmax(logits[[ids_yes, ids_no]], dim=-1)[0].item())
        prompts.append(ids)
    return scores, prompts


@pytest.mark.parametrize("head", ["untied", "tied"])
def test_scores_match_hf(ckpts, head):
    llm = make_llm(ckpts[head])
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    ref, prompts = hf_scores(ckpts[head], [(QUERY, d) for d in DOCS])
    assert [o.prompt_token_ids for o in outs] == prompts
    for out, want in zip(outs, ref):
        assert isinstance(out.outputs.score, float) and out.finished
        assert abs(out.outputs.score - want) < 1e-5
    assert len(set(ref)) == len(ref) and 0 < min(ref) and max(ref) < 1  # distinct, real probabilities
    stats = llm.llm_engine.scheduler_stats()
    assert stats.num_requests == 0 and stats.kv_cache_usage == 0.0
    llm.llm_engine.shutdown()


def test_pairings_instruction_token_ids_and_errors(ckpts):
    path = ckpts["untied"]
    llm = make_llm(path, pooler_config={"pooling_type": "MEAN"})  # a score request pools the last token anyway
    one = llm.score(QUERY, DOCS[0], use_tqdm=False)
    pairwise = llm.score([QUERY, "who wrote it?"], DOCS[:2], use_tqdm=False)
    listed = llm.score([QUERY], DOCS, use_tqdm=False)
    assert len(one) == 1 and len(pairwise) == 2 and len(listed) == 3
    ref, _ = hf_scores(path, [(QUERY, DOCS[0]), ("who wrote it?", DOCS[1])])
    assert abs(pairwise[0].outputs.score - ref[0]) < 1e-5 and abs(pairwise[1].outputs.score - ref[1]) < 1e-5
    assert abs(one[0].outputs.score - listed[0].outputs.score) < 1e-6
    custom = llm.score(QUERY, DOCS[0], use_tqdm=False, instruction="Judge relevance")[0].outputs.score
    assert abs(custom - hf_scores(path, [(QUERY, DOCS[0])], instruction="Judge relevance")[0][0]) < 1e-5
    for t1, t2, field in [(["a", "b"], ["x", "y", "z"], "text_2"), ([], "x", "text_1"), ("a", [], "text_2")]:
        with pytest.raises(ValueError, match=field):
            llm.score(t1, t2, use_tqdm=False)
    llm.llm_engine.shutdown()
    by_id = make_llm(path, score_config={"true_token": 100, "false_token": 7, "instruction": "Rank it"})
    got = by_id.score(QUERY, DOCS[1], use_tqdm=False)[0].outputs.score
    assert abs(got - hf_scores(path, [(QUERY, DOCS[1])], instruction="Rank it", yes_no=(100, 7))[0][0]) < 1e-5
    by_id.llm_engine.shutdown()
    with pytest.raises(ValueError, match="true_token"):
        make_llm(path, score_config={"true_token": "maybe"}).score(QUERY, DOCS[0], use_tqdm=False)


def test_scores_batch_with_embeddings_and_generation(ckpts):
    llm = make_llm(ckpts["untied"])
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    scores_alone = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    prompt = [5, 9, 13, 2, 77]
    gen_alone = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    emb_alone = llm.embed([prompt], use_tqdm=False)[0].outputs.embedding
    engine.reset_prefix_cache()
    yes_no = ScoreConfig().token_ids(engine.tokenizer.tok, engine.ready.vocab_size)
    kinds = {}
    for i, doc in enumerate(DOCS):  # all three kinds share the engine's steps (chunked by the 64-token budget)
        text = ScoreConfig().prompt(QUERY, doc)
        kinds[
            engine.add_request(
                None, text, None, final_only=True, pooling_params=PoolingParams(task="score", score_token_ids=yes_no)
            )
        ] = i
    kinds[engine.add_request(None, prompt, greedy, final_only=True)] = "gen"
    kinds[engine.add_request(None, prompt, None, final_only=True, pooling_params=PoolingParams())] = "emb"
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[kinds[out.request_id]] = out
    for i, want in enumerate(scores_alone):
        assert len(done[i].embedding) == 1 and abs(done[i].embedding[0] - want) < 1e-6
    assert done["gen"].outputs[0].token_ids == gen_alone
    assert len(done["emb"].embedding) == 64
    assert max(abs(a - b) for a, b in zip(done["emb"].embedding, emb_alone)) < 1e-5
    engine.shutdown()


# ---- /v1/score, /v1/rerank, /rerank -----------------------------------------------------------


@pytest.fixture(scope="module")
def server(ckpts):
    with ServerThread(tiny_engine(ckpts["untied"], max_model_len=256, max_num_batched_tokens=64)) as s:
        yield s


@pytest.fixture(scope="module")
def reference(ckpts):
    return hf_scores(ckpts["untied"], [(QUERY, d) for d in DOCS])[0]


def test_score_endpoint(server, reference):
    r = httpx.post(f"{server.url}/v1/score", json={"model": "tiny", "text_1": QUERY, "text_2": DOCS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"] and body["created"] > 0
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"score"}
    for d, want in zip(body["data"], reference):
        assert abs(d["score"] - want) < 1e-5
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    pair = {"model": "tiny", "text_1": [QUERY, QUERY], "text_2": DOCS[1:]}
    pairwise = httpx.post(f"{server.url}/v1/score", json=pair, timeout=60).json()
    assert [abs(d["score"] - w) < 1e-5 for d, w in zip(pairwise["data"], reference[1:])] == [True, True]


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_endpoint(server, reference, path):
    body = {"model": "tiny", "query": QUERY, "documents": DOCS}
    full = httpx.post(server.url + path, json=body, timeout=60).json()
    order = sorted(range(len(DOCS)), key=lambda i: -reference[i])
    assert [x["index"] for x in full["results"]] == order
    assert [x["document"]["text"] for x in full["results"]] == [DOCS[i] for i in order]
    for x in full["results"]:
        assert abs(x["relevance_score"] - reference[x["index"]]) < 1e-5
    assert full["model"] == "tiny" and full["id"] and full["usage"]["total_tokens"] > 0
    top = httpx.post(server.url + path, json={**body, "top_n": 2, "return_documents": False}, timeout=60).json()
    assert [x["index"] for x in top["results"]] == order[:2]
    assert all(x.get("document") is None for x in top["results"])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["x", "y", "z"]}, "text_2"),
        ("/v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/v1/score", {"text_1": "a"}, "text_2"),
        ("/v1/score", {"text_1": "a", "text_2": "x" * 3000}, "text_2"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
        ("/rerank", {"query": "q", "documents": [1, 2]}, "documents[0]"),
    ],
)
def test_bad_score_requests_get_400_naming_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["type"] == "invalid_request_error"
