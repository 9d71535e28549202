"""llama.cpp's encoder files (embedding models) in the names and config keys the checkpoints they were
converted from have: "bert" (BertModel: all-MiniLM, bge) and "nomic-bert" (NomicBertModel: nomic-embed-text
v1 / v1.5). Tensor names are gguf-py's tensor_mapping for the architecture run backwards, so that
ember/model/bert.py reads a GGUF file's tensors as it reads the safetensors the converter read.
"""

from __future__ import annotations

from ember.errors import ModelLoadError
from ember.model.gguf_tokenizer import GGUFMetadata, GGUFVocab

ARCHITECTURES = {"bert": "BertModel", "nomic-bert": "NomicBertModel"}

# As BertModel.state_dict() has them, without "bert.". Its q/k rows are stored as transformers has them: no
# rotary, so no permutation to undo.
_BERT_GLOBAL_TENSORS = {
    "token_embd.weight": "embeddings.word_embeddings.weight",
    "position_embd.weight": "embeddings.position_embeddings.weight",
    "token_types.weight": "embeddings.token_type_embeddings.weight",
    "token_embd_norm.weight": "embeddings.LayerNorm.weight",
    "token_embd_norm.bias": "embeddings.LayerNorm.bias",
}
_BERT_LAYER_TENSORS = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
# nomic-ai's names (what transformers' NomicBert saves too). Its converter keeps the rotary halves as they
# are (llama.cpp rotates nomic-bert NEOX-style, as transformers does): no permutation either.
_NOMIC_GLOBAL_TENSORS = {
    "token_embd.weight": "embeddings.word_embeddings.weight",
    "token_types.weight": "embeddings.token_type_embeddings.weight",
    "token_embd_norm.weight": "emb_ln.weight",
    "token_embd_norm.bias": "emb_ln.bias",
}
_NOMIC_LAYER_TENSORS = {
    "attn_qkv": "attn.Wqkv",
    "attn_output": "attn.out_proj",
    "attn_output_norm": "norm1",
    "ffn_up": "mlp.fc11",
    "ffn_gate": "mlp.fc12",
    "ffn_down": "mlp.fc2",
    "layer_output_norm": "norm2",
}
GLOBAL_TENSORS = {"bert": _BERT_GLOBAL_TENSORS, "nomic-bert": _NOMIC_GLOBAL_TENSORS}
LAYER_TENSORS = {"bert": _BERT_LAYER_TENSORS, "nomic-bert": _NOMIC_LAYER_TENSORS}
LAYER_PREFIXES = {"bert": "encoder.layer", "nomic-bert": "encoder.layers"}
# llama.cpp's llama_pooling_type, as `{arch}.pooling_type` stores it -> Ember's PoolerConfig.pooling_type.
# NONE (every token's state) and RANK (a reranker's classifier head) have no Ember pooler.
_POOLING_TYPES = {1: "MEAN", 2: "CLS", 3: "LAST"}


def encoder_config(meta: GGUFMetadata, vocab: GGUFVocab, arch: str, type_vocab_size: int | None) -> dict:
    """transformers' config keys of a llama.cpp encoder file (BertConfig's, or NomicBertConfig's with the
    rotary base from `nomic-bert.rope.freq_base`), and the pooling its sentence-transformers module
    declared (the converter reads 1_Pooling) as `ember_pooling_type`. `type_vocab_size`: the rows of its
    token_types tensor (None: it has none)."""
    if vocab.model != "bert":  # RoBERTa's byte-level BPE also converts to "bert", with other special tokens
        raise ModelLoadError(meta.path, f"a {arch} file with a {vocab.model!r} vocabulary (Ember reads WordPiece only)")
    if meta.get(f"{arch}.attention.causal", False):
        raise ModelLoadError(meta.path, f"{arch}.attention.causal is true: not a bidirectional encoder")
    if type_vocab_size is None:  # DistilBERT has no token types
        raise ModelLoadError(meta.path, "no token_types.weight tensor (a BERT encoder has token-type embeddings)")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,  # llama.cpp's, as every GGUF config has it (GGUFModel.tensors reads it)
        "vocab_size": meta.get(f"{arch}.vocab_size", len(vocab.tokens)),
        "hidden_size": meta.require(f"{arch}.embedding_length"),
        "intermediate_size": meta.require(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.require(f"{arch}.block_count"),
        "num_attention_heads": meta.require(f"{arch}.attention.head_count"),
        "max_position_embeddings": meta.require(f"{arch}.context_length"),
        "layer_norm_eps": meta.require(f"{arch}.attention.layer_norm_epsilon"),
        "type_vocab_size": type_vocab_size,
        # not in the file: BertModel's (erf) GELU, which the checkpoints converted as bert use; nomic-bert's SwiGLU
        "hidden_act": "silu" if arch == "nomic-bert" else "gelu",
        "ember_pooling_type": _POOLING_TYPES.get(meta.get(f"{arch}.pooling_type")),
    }
    if arch == "nomic-bert":  # the converter writes rotary_emb_base; llama.cpp's default is 10000
        config["rope_theta"] = float(meta.get("nomic-bert.rope.freq_base", 10000.0))
    return config
