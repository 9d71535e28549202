"""llama.cpp "bert" GGUF files (docs/pooling.md, "GGUF embedding models"): a tiny random transformers
BertModel and a BertTokenizerFast, written as llama.cpp's convert_hf_to_gguf.py writes them (phantom-space
WordPiece vocabulary, gguf.SpecialVocab's special ids, gguf-py's tensor names, f32 or f16), read back
through Ember's GGUF loader: the tokenizer encodes and decodes as HF's, every tensor equals the state
dict's, the config is HF's, the pooling type comes from the file, and the engine's embeddings equal
HF's mean-pooled, normalized ones.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QType

from ember import LLM
from ember.errors import ModelLoadError
from ember.model.gguf import load_gguf
from ember.model.gguf_tokenizer import GGUFVocab, open_gguf
from ember.model.hf_config import ModelConfig

# bert-base-uncased's layout: [PAD] 0, [unused*], [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103 (llama.cpp's
# defaults), then words, continuation pieces, characters
SPECIALS = ["[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = "the cat dog sat on mat red blue runs over big house tree water cafe naive un 中 文 , . ! ? ' -".split()
PIECES = ["##ing", "##ed", "##able", "##中", "##"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789")
VOCAB = [*SPECIALS, *WORDS, *PIECES, *CHARS, *(f"##{c}" for c in CHARS)]
TEXTS = [
    "the cat sat on the mat.",
    "Héllo, the CAFÉ naïve cats!! 中文 unable xyzzy",  # accents, case, punctuation, Chinese, unknown pieces
    "  the\tdog\n\nsat [MASK] on the mat ",  # whitespace, a special token in the text
    "[CLS] dogs [SEP]",
    "un-able? ÀÉÎÕÜ ñ 1234567 99",
    "a\u200bb\x00c",  # zero-width space and a control character (clean_text)
    "supercalifragilisticexpialidocious" * 4,  # longer than any piece: [UNK]
    "",
]
PAIRS = [("the cat", "dog runs"), ("Naïve?", "中文 water tree")]
HIDDEN, LAYERS, HEADS, FFN, POSITIONS = 32, 2, 4, 64, 64
# what the converter keeps in float32 in an f16 file, besides vectors: gguf-py's POS_EMBD and TOKEN_TYPES
F32_TABLES = ("embeddings.position_embeddings.weight", "embeddings.token_type_embeddings.weight")


def _hf_tokenizer(tmp_path) -> transformers.PreTrainedTokenizerFast:
    tok = transformers.BertTokenizerFast(vocab={t: i for i, t in enumerate(VOCAB)})
    tok.save_pretrained(tmp_path)  # gguf.SpecialVocab reads the special tokens from the directory
    return tok


def _add_vocab(
    writer: gguf.GGUFWriter, tok: transformers.PreTrainedTokenizerFast, tok_dir, type_count: int, size: int = 0
) -> None:
    """convert_hf_to_gguf's BertModel.set_vocab: get_vocab_base's tokens and types (padded to the model's
    vocab_size `size` with unused "[PAD{i}]"), rewritten to llama.cpp's phantom-space vocabulary (a word start
    gets "\u2581", a continuation loses "##"), then SpecialVocab."""
    by_id = {i: t for t, i in tok.vocab.items()}
    added = tok.get_added_vocab()
    tokens, types = [], []
    for i in range(max(size, len(by_id))):
        token = by_id.get(i, f"[PAD{i}]")
        control = token in added and tok.added_tokens_decoder[i].special
        types.append(
            gguf.TokenType.CONTROL if control else gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED
        )
        tokens.append(token if control else token[2:] if token.startswith("##") else "\u2581" + token)
    writer.add_token_type_count(type_count)
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(tok_dir, n_vocab=len(tokens)).add_to_gguf(writer)


def _write_bert(path, model: transformers.BertModel, tok, tok_dir, qtype: QType, pooling: int | None) -> None:
    """convert_hf_to_gguf's BertModel: its hyperparameters, vocabulary and tensors (the pooler dropped,
    names from gguf-py's tensor map; with f16 every matrix but the position and token-type tables)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_layer_norm_eps(cfg.layer_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if qtype == QType.F16 else gguf.LlamaFileType.ALL_F32)
    writer.add_causal_attention(False)
    if pooling is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling))
    _add_vocab(writer, tok, tok_dir, cfg.type_vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, cfg.num_hidden_layers)
    for hf_name, want in _stored(model, qtype).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        writer.add_tensor(name, want)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _stored(model: transformers.BertModel, qtype: QType) -> dict[str, np.ndarray]:
    """The state dict as the converter stores it: without the pooler, matrices in f16 for an f16 file."""
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("pooler.") or name == "embeddings.position_ids":
            continue
        data = tensor.numpy()
        half = qtype == QType.F16 and data.ndim == 2 and name not in F32_TABLES
        state[name] = data.astype(np.float16) if half else data
    return state


def _bert(type_vocab_size: int = 2) -> transformers.BertModel:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=POSITIONS,
        type_vocab_size=type_vocab_size,
    )
    model = transformers.BertModel(config).eval()
    for p in model.parameters():  # LayerNorms and biases away from their initial 1 and 0
        p.data.normal_(0.0, 0.5 if p.ndim == 1 else 0.1)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{kind: (gguf path, HF model)}: f32 with MEAN pooling, f16 with CLS and one token type; "tokenizer":
    (the HF tokenizer, its directory)."""
    root = tmp_path_factory.mktemp("gguf_bert")
    tok = _hf_tokenizer(root)
    out: dict = {"tokenizer": (tok, root)}
    for kind, qtype, types, pooling in (("f32", QType.F32, 2, 1), ("f16", QType.F16, 1, 2)):
        model, path = _bert(types), root / f"bert-{kind}.gguf"
        _write_bert(path, model, tok, root, qtype, pooling)
        out[kind] = (str(path), model)
    return out


def test_tokenizer_matches_bert_tokenizer_fast(files):
    hf, _ = files["tokenizer"]
    tok = load_gguf(files["f32"][0]).tokenizer
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids == hf(text)["input_ids"], text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids), text
    for first, second in PAIRS:
        enc, ref = tok.encode(first, second), hf(first, second)
        assert (enc.ids, enc.type_ids) == (ref["input_ids"], ref["token_type_ids"])
    assert tok.encode("the cat", add_special_tokens=False).ids == hf("the cat", add_special_tokens=False)["input_ids"]


def test_tokenizer_falls_back_to_llama_cpp_special_ids(files, tmp_path):
    """A file without the special ids (llama.cpp then takes bert-base's [CLS] 101, [SEP] 102, [UNK] 100)."""
    hf, _ = files["tokenizer"]
    writer = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "bert")
    _add_vocab(writer, hf, tmp_path, 2)  # tmp_path holds no tokenizer files: no special ids
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    meta = open_gguf(str(tmp_path / "vocab.gguf"))
    assert meta.get(gguf.Keys.Tokenizer.SEP_ID) is None
    tok = GGUFVocab.read(meta).build()
    assert tok.encode(TEXTS[1]).ids == hf(TEXTS[1])["input_ids"]


@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_config_is_bert_models(files, kind):
    path, model = files[kind]
    cfg = load_gguf(path).hf_config
    hf = model.config
    assert cfg == {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": hf.vocab_size,
        "hidden_size": hf.hidden_size,
        "intermediate_size": hf.intermediate_size,
        "num_hidden_layers": hf.num_hidden_layers,
        "num_attention_heads": hf.num_attention_heads,
        "max_position_embeddings": hf.max_position_embeddings,
        "layer_norm_eps": pytest.approx(hf.layer_norm_eps),
        "type_vocab_size": hf.type_vocab_size,
        "hidden_act": hf.hidden_act,
        "ember_pooling_type": {"f32": "MEAN", "f16": "CLS"}[kind],
    }
    parsed = ModelConfig.from_hf_config(cfg)
    assert parsed.architecture == "BertModel" and parsed.encoder is not None
    assert parsed.encoder.type_vocab_size == hf.type_vocab_size and parsed.encoder.position_offset == 0


@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_tensors_equal_the_state_dict(files, kind):
    path, model = files[kind]
    stored = _stored(model, QType.F16 if kind == "f16" else QType.F32)
    got = dict(load_gguf(path).tensors())
    assert got.keys() == stored.keys()
    for name, want in stored.items():
        assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
        assert np.array_equal(got[name], want.astype(np.float32)), name  # q/k rows as transformers has them
    assert ("float16" in {str(w.dtype) for w in stored.values()}) == (kind == "f16")


@pytest.mark.parametrize("pooling,expected", [(None, None), (0, None), (1, "MEAN"), (2, "CLS"), (3, "LAST")])
def test_pooling_type_from_the_file(files, tmp_path, pooling, expected):
    """llama.cpp's enum: 0 none (every token's state) and no key at all leave the engine's default."""
    tok, tok_dir = files["tokenizer"]
    path = tmp_path / "p.gguf"
    _write_bert(path, files["f32"][1], tok, tok_dir, QType.F32, pooling)
    assert load_gguf(str(path)).hf_config["ember_pooling_type"] == expected


def test_refuses_a_causal_file(files, tmp_path):
    tok, tok_dir = files["tokenizer"]
    path = tmp_path / "causal.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_causal_attention(True)
    _add_vocab(writer, tok, tok_dir, 2)
    writer.add_tensor("token_types.weight", np.zeros((2, HIDDEN), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="causal"):
        load_gguf(str(path))


def test_embeddings_match_hf(files):
    (path, model), (hf_tok, _) = files["f32"], files["tokenizer"]
    llm = LLM(path, runner="pooling", device="cpu", dtype="float32", kv_cache_memory=0.01, engine_process=False)
    assert llm.llm_engine.ready.pooling_type == "MEAN"  # from the file's bert.pooling_type
    texts = TEXTS[:5]
    outs = llm.embed(texts, use_tqdm=False)
    llm.llm_engine.shutdown()
    for text, out in zip(texts, outs):
        with torch.no_grad():
            hidden = model(**hf_tok(text, return_tensors="pt")).last_hidden_state[0]
        ref = torch.nn.functional.normalize(hidden.mean(0), dim=-1)
        got = torch.tensor(out.outputs.embedding)
        assert torch.cosine_similarity(got, ref, dim=0).item() >= 0.99999, text
        assert (got - ref).abs().max().item() < 1e-5, text
