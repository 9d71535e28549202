"""Encoder models (docs/pooling.md): BERT and XLM-R embedding models and cross-encoder rerankers, each a
tiny random checkpoint made here, against HF transformers on the same weights in float32.

Embeddings are the last hidden state pooled as sentence-transformers pools it (mean over the prompt, or
the first token), normalized; scores are the sigmoid of the classifier's logit on the tokenized pair,
with BERT's token types. Also: prompts of many lengths in one step (the CPU attention groups them by
length), whole prompts only (never chunked), `--runner pooling` refusing generation, and the engine's
checks on what each kind of model answers.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import transformers
from conftest import DEVICE
from test_server import ServerThread, tiny_engine

from ember import LLM, PoolingParams, SamplingParams

WORDS = "the a cat dog sat on mat red blue fast slow runs jumps over under big small house tree water".split()
SENTENCES = [
    "the cat sat on the mat",
    "a dog runs",
    "the big red house under the tree",
    "water",
    "the slow blue dog jumps over the small cat on the mat under the big tree",
    "the cat sat on a mat",  # the first one's length: one SDPA call for both
]


def _tokenizer(bert: bool) -> transformers.PreTrainedTokenizerFast:
    """A WordPiece vocabulary with BERT's special tokens and pair layout (`[CLS] A [SEP] B [SEP]`, B's
    tokens of type 1), or XLM-R's (`<s> A </s></s> B </s>`, every token type 0)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    specials = ("[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]") if bert else ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
    cls, pad, sep, unk, mask = specials
    vocab = [*specials, *WORDS, *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz")]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = (processors.BertProcessing if bert else processors.RobertaProcessing)((sep, 2), (cls, 0))
    names = dict(cls_token=cls, pad_token=pad, sep_token=sep, unk_token=unk, mask_token=mask)
    inputs = ["input_ids", "token_type_ids", "attention_mask"]  # as BertTokenizerFast: the types reach the model
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, model_input_names=inputs, **names)


def _save(model: transformers.PreTrainedModel, tokenizer, path, pooling: str | None = None) -> str:
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if pooling is not None:  # a sentence-transformers directory's pooling module
        (path / "1_Pooling").mkdir()
        (path / "2_Normalize").mkdir()
        flags = {"word_embedding_dimension": model.config.hidden_size, f"pooling_mode_{pooling}": True}
        (path / "1_Pooling" / "config.json").write_text(json.dumps(flags))
        modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
        (path / "modules.json").write_text(
            json.dumps(
                [
                    {"idx": i, "name": str(i), "path": where, "type": f"sentence_transformers.models.{kind}"}
                    for i, (where, kind) in enumerate(modules)
                ]
            )
        )
    return str(path)


def bert_config(**kwargs) -> dict:
    sizes = dict(
        vocab_size=5 + len(WORDS) + 26,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        type_vocab_size=2,
    )
    return {**sizes, **kwargs}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    torch.manual_seed(0)
    tok = _tokenizer(bert=True)
    out = {}
    model = transformers.BertModel(transformers.BertConfig(**bert_config())).eval()
    out["bert"] = _save(model, tok, root / "bert", pooling="mean_tokens")
    cross = transformers.BertForSequenceClassification(transformers.BertConfig(**bert_config(num_labels=1))).eval()
    cross.bert.embeddings.token_type_embeddings.weight.data.normal_(0.0, 1.0)  # types that move the score
    out["bert-cross"] = _save(cross, tok, root / "bert-cross")
    rtok = _tokenizer(bert=False)
    xcfg = bert_config(type_vocab_size=1, pad_token_id=1, max_position_embeddings=66)  # positions from 2
    xlmr = transformers.XLMRobertaModel(transformers.XLMRobertaConfig(**xcfg)).eval()
    out["xlmr"] = _save(xlmr, rtok, root / "xlmr", pooling="cls_token")
    xcross = transformers.XLMRobertaForSequenceClassification(transformers.XLMRobertaConfig(**xcfg, num_labels=1))
    out["xlmr-cross"] = _save(xcross.eval(), rtok, root / "xlmr-cross")
    return out


def make_llm(path: str, **kwargs) -> LLM:
    return LLM(path, device=DEVICE, dtype="float32", kv_cache_memory=0.01, engine_process=False, **kwargs)


def hf_embedding(path: str, text: str, pooling: str) -> torch.Tensor:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]
    vec = hidden.mean(0) if pooling == "MEAN" else hidden[0]
    return torch.nn.functional.normalize(vec, dim=-1)


def hf_score(path: str, query: str, doc: str) -> float:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.sigmoid(model(**tok(query, doc, return_tensors="pt")).logits[0, 0]).item()


def assert_same_vector(got: list[float], ref: torch.Tensor) -> None:
    g = torch.tensor(got)
    assert g.shape == ref.shape
    assert torch.cosine_similarity(g, ref, dim=0).item() >= 0.99999
    assert (g - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("kind,pooling", [("bert", "MEAN"), ("xlmr", "CLS")])
def test_embeddings_match_hf(models, kind, pooling):
    llm = make_llm(models[kind])
    ready = llm.llm_engine.ready
    assert ready.runner == "pooling" and ready.pooling_type == pooling  # from the directory's 1_Pooling
    outs = llm.embed(SENTENCES, use_tqdm=False)  # one step: all prompts side by side
    for text, out in zip(SENTENCES, outs):
        assert_same_vector(out.outputs.embedding, hf_embedding(models[kind], text, pooling))
    stats = llm.llm_engine.scheduler_stats()
    assert stats.num_requests == 0 and stats.kv_cache_usage == 0.0
    llm.llm_engine.shutdown()


def test_prompts_are_never_split_and_wait_for_a_whole_step(models):
    """A budget of 16 tokens (the context, 16): a 15-token prompt waits for a step of its own."""
    llm = make_llm(models["bert"], max_model_len=16, max_num_batched_tokens=16)
    texts = ["the cat sat on the mat under the big red tree", "a dog", "water runs"]
    outs = llm.embed(texts, use_tqdm=False)
    for text, out in zip(texts, outs):
        assert_same_vector(out.outputs.embedding, hf_embedding(models["bert"], text, "MEAN"))
    with pytest.raises(ValueError, match="max_num_batched_tokens 8 is less than max_model_len 16"):
        make_llm(models["bert"], max_model_len=16, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="64 learned positions"):
        make_llm(models["bert"], max_model_len=65)
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("kind", ["bert-cross", "xlmr-cross"])
def test_cross_encoder_scores_match_hf(models, kind):
    llm = make_llm(models[kind])
    assert llm.llm_engine.ready.num_labels == 1
    query = "the cat"
    outs = llm.score(query, SENTENCES, use_tqdm=False)
    for doc, out in zip(SENTENCES, outs):
        assert out.outputs.score == pytest.approx(hf_score(models[kind], query, doc), abs=1e-6)
    pairwise = llm.score(SENTENCES[:2], SENTENCES[2:4], use_tqdm=False)
    for (q, d), out in zip(zip(SENTENCES[:2], SENTENCES[2:4]), pairwise):
        assert out.outputs.score == pytest.approx(hf_score(models[kind], q, d), abs=1e-6)
    llm.llm_engine.shutdown()


def test_token_types_reach_the_model(models):
    """BERT's second text is of type 1: with its types moved the score moves, by far more than the 1e-6 within
    which scores match HF's (the random classifier's logits are small, so its scores stay near 0.5)."""
    llm = make_llm(models["bert-cross"])
    tok = llm.llm_engine.tokenizer
    assert tok is not None
    ids, second = tok.encode_pair("the cat", "a dog runs")
    assert second == 4  # [CLS] the cat [SEP] | a dog runs [SEP]
    (typed,) = llm.score("the cat", "a dog runs", use_tqdm=False)
    untyped = llm.embed(
        {"prompt_token_ids": ids}, PoolingParams(task="score", token_type_start=len(ids) - 1), use_tqdm=False
    )[0]
    assert abs(untyped.outputs.embedding[0] - typed.outputs.score) > 1e-5
    llm.llm_engine.shutdown()


def test_what_each_model_answers(models):
    embedder, cross = make_llm(models["bert"]), make_llm(models["bert-cross"])
    with pytest.raises(ValueError, match="serves embeddings and scores only"):
        embedder.generate("the cat", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="task 'score': this encoder has 0 labels"):
        embedder.score("the cat", "a dog", use_tqdm=False)
    with pytest.raises(ValueError, match="task 'embed': this model is a classifier"):
        cross.embed("the cat", use_tqdm=False)
    with pytest.raises(ValueError, match="runner 'generate'"):
        make_llm(models["bert"], runner="generate")
    with pytest.raises(ValueError, match="enable_lora: not supported for encoder models"):
        make_llm(models["bert"], enable_lora=True)
    for llm in (embedder, cross):
        llm.llm_engine.shutdown()


def test_server_embeds_and_reranks_with_encoders(models):
    """The openai client's embeddings.create on a BERT embedding model, /rerank on a cross-encoder (sorted,
    equal to HF's scores), and a completion request to a pooling engine refused with OpenAI's error shape."""
    texts = SENTENCES[:3]
    with ServerThread(tiny_engine(models["bert"])) as server:
        data = server.client().embeddings.create(model="tiny", input=texts, encoding_format="float").data
        for text, item in zip(texts, data):
            assert_same_vector(item.embedding, hf_embedding(models["bert"], text, "MEAN"))
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "the cat", "max_tokens": 2})
        assert r.status_code == 400 and "serves embeddings and scores only" in r.json()["error"]["message"]
    with ServerThread(tiny_engine(models["bert-cross"])) as server:
        body = {"query": "the cat", "documents": SENTENCES, "top_n": 3}
        results = httpx.post(f"{server.url}/rerank", json=body).json()["results"]
        want = sorted(
            ((hf_score(models["bert-cross"], "the cat", d), i) for i, d in enumerate(SENTENCES)), reverse=True
        )
        assert [r["index"] for r in results] == [i for _, i in want[:3]]
        for r, (score, _) in zip(results, want):
            assert r["relevance_score"] == pytest.approx(score, abs=1e-6)


def test_sentence_transformers_agree(models):
    """The references users compare with: SentenceTransformer.encode on the sentence-transformers directory
    (tokenizer, Transformer, its 1_Pooling, Normalize) and CrossEncoder.predict on the classifier."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    llm = make_llm(models["bert"])
    ref = SentenceTransformer(models["bert"], device="cpu").encode(SENTENCES, convert_to_tensor=True)
    for out, want in zip(llm.embed(SENTENCES, use_tqdm=False), ref):
        assert_same_vector(out.outputs.embedding, want.float())
    llm.llm_engine.shutdown()
    cross = make_llm(models["bert-cross"])
    pairs = [("the cat", doc) for doc in SENTENCES]
    want = CrossEncoder(models["bert-cross"], device="cpu").predict(pairs)
    got = [o.outputs.score for o in cross.score("the cat", SENTENCES, use_tqdm=False)]
    assert got == pytest.approx(want.tolist(), abs=1e-6)
    cross.llm_engine.shutdown()
