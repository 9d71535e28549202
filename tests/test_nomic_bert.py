"""nomic-bert embedding models (docs/pooling.md, "Encoder models" and "GGUF embedding models"): a tiny random
transformers NomicBertModel (rotary positions, SwiGLU, fused Wqkv, no biases) with a BertTokenizerFast and a
sentence-transformers MEAN pooling module, float32 on CPU. Ember's embeddings equal HF's mean-pooled,
normalized last hidden state from the directory transformers saves, from the same weights under nomic-ai's
own config.json keys, and from llama.cpp "nomic-bert" GGUF files (f32, f16) written as its converter writes
them.
"""

from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from gguf import GGMLQuantizationType as QType
from test_encoders import _save, assert_same_vector, make_llm
from test_gguf_bert import TEXTS, VOCAB, _add_vocab, _hf_tokenizer

from ember import PoolingParams
from ember.errors import ModelLoadError
from ember.model.gguf import load_gguf
from ember.model.hf_config import ModelConfig

HIDDEN, LAYERS, HEADS, FFN, POSITIONS = 32, 2, 4, 48, 64
THETA = 2000.0  # not transformers' default 1000, so that a base that is not read shows
PADDED_VOCAB = len(VOCAB) + 6  # nomic-ai pads its vocabulary to a multiple of 64, past the tokenizer's
PROMPTS = [t for t in TEXTS if t][:6]  # lengths 7 to 35: every position's rotation is used


def _nomic() -> transformers.NomicBertModel:
    torch.manual_seed(0)
    config = transformers.NomicBertConfig(
        vocab_size=PADDED_VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
    )
    model = transformers.NomicBertModel(config).eval()
    for p in model.parameters():  # LayerNorms away from their initial 1 and 0
        p.data.normal_(0.0, 0.5 if p.ndim == 1 else 0.1)
    model.embeddings.token_type_embeddings.weight.data.normal_(0.0, 0.5)
    return model


def _nomic_ai_config(hf: transformers.NomicBertConfig) -> dict:
    """The same model as nomic-ai's config.json describes it (for its remote code: GPT-2's key names, its
    switches, n_positions 8192 with a trained context of 2048)."""
    return {
        "architectures": ["NomicBertModel"],
        "model_type": "nomic_bert",
        "activation_function": "swiglu",
        "causal": False,
        "prenorm": False,
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "rotary_emb_base": THETA,
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "rotary_emb_scale_base": None,
        "rotary_scaling_factor": None,
        "layer_norm_epsilon": hf.layer_norm_eps,
        "max_trained_positions": POSITIONS,
        "n_positions": 8192,
        "n_embd": HIDDEN,
        "n_head": HEADS,
        "n_inner": FFN,
        "n_layer": LAYERS,
        "type_vocab_size": hf.type_vocab_size,
        "vocab_size": PADDED_VOCAB,
        "pad_vocab_size_multiple": 64,
    }


def _write_gguf(path, ckpt: dict[str, torch.Tensor], cfg: dict, tok, tok_dir, qtype: QType) -> None:
    """convert_hf_to_gguf's NomicBertModel (a BertModel): the hyperparameters (the context the trained one, as
    the converter sets n_positions), the rotary base, MEAN pooling from 1_Pooling, the padded WordPiece
    vocabulary, and the safetensors' tensors under gguf-py's nomic-bert names (f16: every matrix but the
    token types)."""
    writer = gguf.GGUFWriter(str(path), "nomic-bert")
    writer.add_context_length(cfg["max_trained_positions"])
    writer.add_embedding_length(cfg["n_embd"])
    writer.add_feed_forward_length(cfg["n_inner"])
    writer.add_block_count(cfg["n_layer"])
    writer.add_head_count(cfg["n_head"])
    writer.add_layer_norm_eps(cfg["layer_norm_epsilon"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if qtype == QType.F16 else gguf.LlamaFileType.ALL_F32)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_rope_freq_base(cfg["rotary_emb_base"])
    _add_vocab(writer, tok, tok_dir, cfg["type_vocab_size"], size=cfg["vocab_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NOMIC_BERT, cfg["n_layer"])
    for hf_name, tensor in ckpt.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = tensor.numpy()
        half = qtype == QType.F16 and data.ndim == 2 and name != "token_types.weight"
        writer.add_tensor(name, data.astype(np.float16) if half else data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def nomic(tmp_path_factory):
    """{"hf": transformers' directory, "nomic-ai": the same weights under nomic-ai's config, "f32" / "f16":
    GGUF files, "model": the HF model, "tokenizer": its tokenizer, "ckpt": the saved tensors}."""
    root = tmp_path_factory.mktemp("nomic_bert")
    tok_dir = root / "tok"
    tok = _hf_tokenizer(tok_dir)
    model = _nomic()
    out: dict = {"model": model, "tokenizer": tok}
    out["hf"] = _save(model, tok, root / "hf", pooling="mean_tokens")
    out["ckpt"] = safetensors.torch.load_file(f"{out['hf']}/model.safetensors")
    theirs = root / "nomic-ai"
    _save(model, tok, theirs, pooling="mean_tokens")
    cfg = _nomic_ai_config(model.config)
    (theirs / "config.json").write_text(json.dumps(cfg))
    out["nomic-ai"] = str(theirs)
    for kind, qtype in (("f32", QType.F32), ("f16", QType.F16)):
        out[kind] = str(root / f"nomic-{kind}.gguf")
        _write_gguf(out[kind], out["ckpt"], cfg, tok, tok_dir, qtype)
    return out


def _hf_embeddings(nomic, texts: list[str]) -> list[torch.Tensor]:
    model, tok = nomic["model"], nomic["tokenizer"]
    with torch.no_grad():
        hidden = [model(**tok(text, return_tensors="pt")).last_hidden_state[0] for text in texts]
    return [torch.nn.functional.normalize(h.mean(0), dim=-1) for h in hidden]


def test_checkpoint_names_are_nomic_ais(nomic):
    """transformers saves nomic-ai's names (Wqkv, fc11 / fc12 / fc2, norm1 / norm2, emb_ln), which Ember reads."""
    assert {n.split(".", 3)[-1] for n in nomic["ckpt"] if n.startswith("encoder.layers.0.")} == {
        "attn.Wqkv.weight",
        "attn.out_proj.weight",
        "mlp.fc11.weight",
        "mlp.fc12.weight",
        "mlp.fc2.weight",
        "norm1.weight",
        "norm1.bias",
        "norm2.weight",
        "norm2.bias",
    }


@pytest.mark.parametrize("kind", ["hf", "nomic-ai", "f32", "f16"])
def test_embeddings_match_hf(nomic, kind):
    """Six prompts of six lengths in one step against HF's per-prompt forward: max abs error 6e-8 from the
    float32 weights (measured; asserted < 1e-5), 3.0e-5 from the f16 file's matrices rounded to f16 (asserted
    < 1e-4); cosine >= 0.99999 for all."""
    llm = make_llm(nomic[kind])
    ready = llm.llm_engine.ready
    assert ready.runner == "pooling" and ready.pooling_type == "MEAN"  # 1_Pooling, or nomic-bert.pooling_type
    outs = llm.embed(PROMPTS, use_tqdm=False)
    for text, out, ref in zip(PROMPTS, outs, _hf_embeddings(nomic, PROMPTS)):
        if kind == "f16":
            got = torch.tensor(out.outputs.embedding)
            assert torch.cosine_similarity(got, ref, dim=0).item() >= 0.99999, text
            assert (got - ref).abs().max().item() < 1e-4, text
        else:
            assert_same_vector(out.outputs.embedding, ref)  # cosine >= 0.99999, max abs error < 1e-5
    llm.llm_engine.shutdown()


def test_sentence_transformers_agree(nomic):
    """SentenceTransformer.encode on the directory (tokenizer, transformers' NomicBertModel, 1_Pooling,
    Normalize), the reference nomic-embed-text's model card uses."""
    from sentence_transformers import SentenceTransformer

    llm = make_llm(nomic["hf"])
    ref = SentenceTransformer(nomic["hf"], device="cpu").encode(PROMPTS, convert_to_tensor=True)
    for out, want in zip(llm.embed(PROMPTS, use_tqdm=False), ref):
        assert_same_vector(out.outputs.embedding, want.float())
    llm.llm_engine.shutdown()


def test_matryoshka_dimensions(nomic):
    """nomic-embed-text v1.5 is trained for Matryoshka cuts: `dimensions` keeps the first values, renormalized."""
    llm = make_llm(nomic["hf"])
    outs = llm.embed(PROMPTS[:2], PoolingParams(dimensions=16), use_tqdm=False)
    for out, ref in zip(outs, _hf_embeddings(nomic, PROMPTS[:2])):
        assert_same_vector(out.outputs.embedding, torch.nn.functional.normalize(ref[:16], dim=-1))
    llm.llm_engine.shutdown()


def test_configs_in_both_key_sets(nomic):
    ours = json.loads(open(f"{nomic['hf']}/config.json").read())
    theirs = _nomic_ai_config(nomic["model"].config)
    a, b = ModelConfig.from_hf_config(ours), ModelConfig.from_hf_config(theirs)
    assert a == b
    assert a.encoder is not None and a.encoder.nomic and not a.attention_bias
    assert (a.rope_theta, a.max_position_embeddings, a.head_dim) == (THETA, POSITIONS, HIDDEN // HEADS)
    g = ModelConfig.from_hf_config(load_gguf(nomic["f32"]).hf_config)
    assert g.encoder is not None and g.encoder.layer_norm_eps == pytest.approx(a.rms_norm_eps)  # stored as f32
    eps = a.rms_norm_eps
    assert dataclasses.replace(g, rms_norm_eps=eps, encoder=dataclasses.replace(g.encoder, layer_norm_eps=eps)) == a


@pytest.mark.parametrize(
    "key,value",
    [
        ("rotary_scaling_factor", 2.0),  # dynamic NTK past the trained context
        ("rotary_emb_fraction", 0.5),
        ("rotary_emb_interleaved", True),
        ("qkv_proj_bias", True),
        ("prenorm", True),
        ("activation_function", "gelu"),
        ("moe_every_n_layers", 2),  # nomic-embed-text-v2-moe
    ],
)
def test_refuses_other_nomic_variants(nomic, key, value):
    with pytest.raises(ValueError, match=f"{key} .* is not supported for NomicBertModel"):
        ModelConfig.from_hf_config({**_nomic_ai_config(nomic["model"].config), key: value})


@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_gguf_tensors_are_the_checkpoints(nomic, kind):
    """Every tensor comes back under the safetensors' name, equal to it (f16: to its f16 rounding)."""
    got = dict(load_gguf(nomic[kind]).tensors())
    assert got.keys() == nomic["ckpt"].keys()
    for name, want in nomic["ckpt"].items():
        data = want.numpy()
        if kind == "f16" and data.ndim == 2 and name != "embeddings.token_type_embeddings.weight":
            data = data.astype(np.float16)
        assert np.array_equal(got[name], data.astype(np.float32)), name


def test_gguf_vocabulary_and_refusals(nomic, tmp_path):
    """The padded vocabulary tokenizes as the HF tokenizer; a causal file is refused."""
    g = load_gguf(nomic["f32"])
    assert len(g.vocab.tokens) == PADDED_VOCAB == g.hf_config["vocab_size"]
    for text in PROMPTS:
        assert g.tokenizer.encode(text).ids == nomic["tokenizer"](text)["input_ids"], text
    writer = gguf.GGUFWriter(str(tmp_path / "causal.gguf"), "nomic-bert")
    writer.add_causal_attention(True)
    _add_vocab(writer, nomic["tokenizer"], tmp_path, 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="nomic-bert.attention.causal is true"):
        load_gguf(str(tmp_path / "causal.gguf"))
