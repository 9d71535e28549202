"""Engine configuration: the user-facing `EngineArgs` and the resolved configs the engine runs on.

`EngineArgs` holds exactly what a user can set (flag names follow vLLM's so users can switch
without rereading docs); `EngineArgs.create_config()` resolves defaults that depend on the model
and the machine into the frozen configs below.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
_DTYPES = {  # name -> torch dtype attribute; resolved only when a torch dtype is needed, so that
    # reading flags (`ember --help`) never imports torch
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# None: a GGUF file keeps its own quantization ("gguf"), an HF checkpoint its config.json's
# quantization_config (awq, gptq, compressed-tensors, fp8), other checkpoints load unquantized ("none").
QUANTIZATIONS = ("none", "gguf", "int8", "int4", "fp8", "awq", "gptq", "compressed-tensors", "ptpc_fp8", "mxfp4")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: E gated experts, each token's MLP the weighted sum of its top-k."""

    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's
    renormalize: bool  # top-k softmax weights divided by their sum (Mixtral always; Qwen3-MoE: norm_topk_prob)
    dense_layers: tuple[int, ...] = ()  # dense-MLP layers (Qwen3-MoE: mlp_only_layers, decoder_sparse_step)
    bias: bool = False  # router and experts with biases (gpt-oss)
    # gpt-oss's clamped SwiGLU (alpha, limit): (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g) with
    # g = min(gate, limit); None: silu(gate) * up
    swiglu: tuple[float, float] | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, in Hugging Face `config.json` terms."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    # Gemma: (1 + w) norms, four norms per layer, embeddings scaled by sqrt(hidden), GELU-tanh MLP
    gemma_norms: bool = False
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (default: head_dim)
    # "sliding_attention" / "full_attention" per layer; None: every layer attends to its whole context
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None  # keys a query sees in a sliding layer, itself included
    # rope of the sliding layers where it differs from the global one (Gemma 3's local base)
    rope_local_theta: float | None = None
    rope_local_scaling: dict[str, Any] | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    o_proj_bias: bool = False  # gpt-oss: attention_bias covers the output projection too
    attention_sinks: bool = False  # gpt-oss: a learned logit per query head in every softmax denominator

    def layer_window(self, layer: int) -> int | None:
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    partial_rotary_factor: float = 1.0  # the share of each head that is rotated (Phi-4-mini: 0.75)
    moe: MoeConfig | None = None  # mixture-of-experts models (Qwen3-MoE, Mixtral)

    def layer_is_moe(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch in _GEMMA_DEFAULTS:
            if arch == "Gemma3ForConditionalGeneration":
                cfg = cfg["text_config"]
            cfg = {**_GEMMA_DEFAULTS[arch], **cfg}
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // heads
        rope_theta, rope_scaling = _rope(cfg, "full_attention")
        gemma = arch in _GEMMA_DEFAULTS
        local_theta, local_scaling = None, None
        if arch in _GEMMA3:  # transformers' defaults: 1e6 for the global layers, 1e4 for the local ones
            rope_theta = rope_theta or 1_000_000.0
            local_theta, local_scaling = _rope(cfg, "sliding_attention")
            local_theta = local_theta or 10_000.0
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or _DEFAULT_THETA.get(arch, 10000.0)),
            rope_scaling=_resolve_yarn(_resolve_longrope(rope_scaling, cfg), cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch in ("Qwen2ForCausalLM", _GPT_OSS))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *_GEMMA3),
            gemma_norms=gemma,
            hidden_act="gelu_pytorch_tanh" if gemma else "silu",
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if gemma else None,
            layer_types=_layer_types(arch, cfg),
            sliding_window=cfg.get("sliding_window") if arch in _SLIDING else None,
            rope_local_theta=None if local_theta is None else float(local_theta),
            rope_local_scaling=local_scaling,
            # transformers' Gemma 3 attention ignores attn_logit_softcapping, so Ember does too
            attn_logit_softcapping=cfg.get("attn_logit_softcapping") if arch == "Gemma2ForCausalLM" else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma else None,
            partial_rotary_factor=_partial_rotary_factor(cfg),
            moe=_moe(arch, cfg),
            o_proj_bias=arch == _GPT_OSS and bool(cfg.get("attention_bias", True)),
            attention_sinks=arch == _GPT_OSS,
        )

    def for_max_model_len(self, max_model_len: int) -> ModelConfig:
        """This config with LongRoPE's factor set chosen for an engine whose sequences reach max_model_len.

        As vLLM and llama.cpp do, one set serves every position of every sequence: the long factors
        when sequences may outgrow original_max_position_embeddings, else the short ones. A token's
        cached keys then never depend on how long its sequence grows later. transformers instead
        rotates a sequence with the short factors until it passes that length and then recomputes its
        whole context with the long ones; the two agree on every token while max_model_len stays
        within the pre-training length, and otherwise on every token produced after the sequence
        has passed it (a prompt longer than the pre-training length: all of them)."""
        if self.rope_scaling is None or _rope_type(self.rope_scaling) != "longrope":
            return self
        use_long = max_model_len > self.rope_scaling["original_max_position_embeddings"]
        return dataclasses.replace(self, rope_scaling={**self.rope_scaling, "use_long_factors": use_long})

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each head that RoPE rotates; the rest pass through (HF's rounding)."""
        return int(self.head_dim * self.partial_rotary_factor)


def _moe(arch: str, cfg: dict[str, Any]) -> MoeConfig | None:
    """Qwen3-MoE and Mixtral route each token to its top-k experts by a softmax over all of them.
    What they do not share is refused by name: shared experts (Qwen2-MoE's), other activations, and
    Qwen3-MoE's sliding window (off in every released checkpoint)."""
    if arch == _GPT_OSS:
        return _gpt_oss_moe(cfg)
    if arch not in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        return None
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if cfg.get(key):
            raise ValueError(f"{key}: shared experts are not supported for {arch}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported for {arch} experts (silu only)")
    dense: tuple[int, ...]
    if arch == "MixtralForCausalLM":
        num_experts, inter, renormalize, dense = cfg["num_local_experts"], cfg["intermediate_size"], True, ()
    else:
        if cfg.get("use_sliding_window"):
            raise ValueError(f"use_sliding_window is not supported for {arch}")
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        inter, renormalize = cfg["moe_intermediate_size"], bool(cfg.get("norm_topk_prob", False))
        step, only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        dense = tuple(
            i for i in range(cfg["num_hidden_layers"]) if i in only or num_experts == 0 or (i + 1) % step
        )  # transformers' rule
    top_k = cfg["num_experts_per_tok"]
    if num_experts and not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the number of experts ({num_experts})")
    return MoeConfig(
        num_experts=num_experts, top_k=top_k, intermediate_size=inter, renormalize=renormalize, dense_layers=dense
    )


def _gpt_oss_moe(cfg: dict[str, Any]) -> MoeConfig:
    """gpt-oss takes the softmax of the top-k router logits, which is the softmax over all experts
    renormalised over the top k; its config's hidden_act is unused (the experts' clamped SwiGLU is fixed)."""
    num_experts, top_k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the number of experts ({num_experts})")
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=cfg["intermediate_size"],
        renormalize=True,
        bias=True,
        swiglu=(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))),
    )


def _resolve_yarn(scaling: dict[str, Any] | None, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """YaRN (gpt-oss) with its defaults resolved as transformers' `_compute_yarn_parameters` resolves
    them: factor from the two lengths when absent, beta_fast 32 / beta_slow 1, truncate on, and the
    cos/sin scale (attention_factor) from mscale / mscale_all_dim, else 0.1 ln(factor) + 1."""
    if scaling is None or _rope_type(scaling) != "yarn":
        return scaling
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_scaling: yarn needs original_max_position_embeddings")
    factor = float(scaling.get("factor") or cfg["max_position_embeddings"] / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": int(original),
        "beta_fast": float(scaling.get("beta_fast") or 32),
        "beta_slow": float(scaling.get("beta_slow") or 1),
        "truncate": bool(scaling.get("truncate", True)),
        "attention_factor": float(attention_factor),
    }


def _rope_type(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def _partial_rotary_factor(cfg: dict[str, Any]) -> float:
    """Top level in config.json (Phi-4-mini), inside `rope_parameters` in transformers >= 5's."""
    params = cfg.get("rope_parameters")
    return float(
        cfg.get("partial_rotary_factor")
        or (params if isinstance(params, dict) else {}).get("partial_rotary_factor")
        or 1.0
    )


def _resolve_longrope(scaling: dict[str, Any] | None, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """LongRoPE (Phi-3, also under its old name 'su') with every default resolved the way transformers'
    `_compute_longrope_parameters` resolves it, so the rotary table needs nothing but this dict: the
    pre-training length may sit beside the factors or at the top of config.json, `factor` defaults to
    max_position_embeddings / original_max_position_embeddings, and the cos/sin scale to
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) (1 when factor <= 1)."""
    if scaling is None or _rope_type(scaling) not in ("longrope", "su"):
        return scaling
    # transformers lets the top-level value win where both are given
    original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_scaling: longrope needs original_max_position_embeddings")
    original = int(original)
    factor = scaling.get("factor") or cfg.get("max_position_embeddings", original) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return {
        "rope_type": "longrope",
        "short_factor": list(scaling["short_factor"]),
        "long_factor": list(scaling["long_factor"]),
        "original_max_position_embeddings": original,
        "factor": float(factor),
        "attention_factor": float(attention_factor),
    }


_GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# transformers' config defaults for keys that Gemma configs on the Hub leave out (Gemma 3's
# multimodal configs give little more than the sizes under `text_config`)
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
}
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma2ForCausalLM": {
        "vocab_size": 256_000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 2,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    **dict.fromkeys(_GEMMA3, _GEMMA3_DEFAULTS),
}
_GPT_OSS = "GptOssForCausalLM"
_DEFAULT_THETA = {_GPT_OSS: 150_000.0}  # transformers' config defaults where config.json gives none
# architectures whose `sliding_window` is used (Qwen2 configs carry one that is off unless use_sliding_window)
_SLIDING = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", _GPT_OSS, *_GEMMA_DEFAULTS)


def _layer_types(arch: str, cfg: dict[str, Any]) -> tuple[str, ...] | None:
    """transformers 5 configs list each layer's type; older ones give a period where every
    `sliding_window_pattern`-th layer is global (Gemma), or make every layer slide (Mistral)."""
    if arch not in _SLIDING or cfg.get("sliding_window") is None:
        return None
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    period = cfg.get("sliding_window_pattern") if arch in _GEMMA_DEFAULTS else 2 if arch == _GPT_OSS else None
    return tuple(
        "sliding_attention" if period is None or (i + 1) % period else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    )


def _rope(cfg: dict[str, Any], layer_type: str) -> tuple[float | None, dict[str, Any] | None]:
    """(theta, scaling) of one layer type. transformers >= 5 puts them under `rope_parameters`, one dict
    for all layers or one per layer type (Gemma 3); older configs give `rope_theta` and `rope_scaling`
    (Gemma 3: for the global layers; the local ones use `rope_local_base_freq`, unscaled)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if not isinstance(params, dict) or not ({"rope_theta", "rope_type"} & params.keys()):
        params = {}
    scaling = params if params.get("rope_type", "default") != "default" else None
    if layer_type == "sliding_attention":
        return params.get("rope_theta", cfg.get("rope_local_base_freq")), scaling
    return cfg.get("rope_theta") or params.get("rope_theta"), cfg.get("rope_scaling") or scaling


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class RunnerConfig:
    """What the model runner needs beyond the model, cache and scheduler configs, resolved."""

    dtype: str  # torch dtype name: float32, float16 or bfloat16
    kv_cache_dtype: str  # "auto" (the model's dtype) or "fp8"
    seed: int
    enforce_eager: bool


@dataclass
class EngineArgs:
    """Everything a user can configure; names match vLLM's `EngineArgs` / CLI flags."""

    model: str | None = None
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: float | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    chat_template: str | None = None
    served_model_name: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    # Plan step N+1 on the host while the GPU runs step N (None: on for one CUDA GPU; see EngineCore).
    async_scheduling: bool | None = None
    # Run the engine core in its own process (None: each front end's default; see core_client.py).
    engine_process: bool | None = None
    # Front end only: a file of phrases to stop before (one a line), or the phrases themselves (see content_filter.py).
    blocked_words: str | list[str] | None = None

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        _check_int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.max_num_batched_tokens is not None:
            _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not (
            self.blocked_words is None
            or isinstance(self.blocked_words, str)
            or (isinstance(self.blocked_words, list) and all(isinstance(w, str) for w in self.blocked_words))
        ):
            raise ValueError(f"blocked_words must be a file path or a list of phrases, got {self.blocked_words!r}")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be a positive number of GiB, got {self.kv_cache_memory}")

    def runner_config(self, device: torch.device, checkpoint_dtype: str | None) -> RunnerConfig:
        """bf16 on GPUs by default, float32 on CPU where bf16 matmuls are slow on most CPUs."""
        if self.dtype != "auto":
            dtype = _DTYPES[self.dtype]
        elif device.type == "cpu":
            dtype = "float32"
        else:
            dtype = checkpoint_dtype if checkpoint_dtype in ("float16", "bfloat16") else "bfloat16"
        kv = "auto" if self.kv_cache_dtype == "auto" else "fp8"
        return RunnerConfig(dtype=dtype, kv_cache_dtype=kv, seed=self.seed, enforce_eager=self.enforce_eager)

    def cache_config(self) -> CacheConfig:
        kv_bytes = None if self.kv_cache_memory is None else int(self.kv_cache_memory * (1 << 30))
        return CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_bytes,
        )

    def scheduler_config(self, model_config: ModelConfig, device: torch.device) -> SchedulerConfig:
        max_len = self.max_model_len or model_config.max_position_embeddings
        budget = self.max_num_batched_tokens or (8192 if device.type == "cuda" else 2048)
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_len)

    # ---- command line -------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("engine")
        g.add_argument(
            "--model",
            dest="model_flag",
            metavar="MODEL",
            default=None,
            help=f"HF model directory, .gguf file, or '{DEFAULT_MODEL}' (default)",
        )
        g.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: the model's)")
        g.add_argument(
            "--load-format",
            default="auto",
            choices=LOAD_FORMATS,
            help="'dummy' makes random weights from config.json alone",
        )
        g.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
        g.add_argument("--device", default="auto", help="auto, cpu or cuda")
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        g.add_argument("--kv-cache-memory", type=float, default=None, help="KV cache size in GiB (CPU)")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        g.add_argument("--max-num-seqs", type=int, default=256)
        g.add_argument("--max-num-batched-tokens", type=int, default=None)
        g.add_argument("--enforce-eager", action="store_true")
        g.add_argument("--chat-template", default=None, help="a Jinja2 chat template file or string")
        g.add_argument(
            "--quantization",
            "-q",
            default=None,
            choices=QUANTIZATIONS,
            help="weight quantization applied at load (default: a GGUF file keeps its own, 'gguf', an "
            "HF checkpoint its config.json's quantization_config; others load unquantized). 'fp8' "
            "is W8A8 with 128x128 weight blocks and 1x128 activation groups; 'ptpc_fp8' one scale "
            "per weight row and per token",
        )
        g.add_argument(
            "--kv-cache-dtype",
            default="auto",
            choices=KV_CACHE_DTYPES,
            help="'fp8' stores keys and values as float8 e4m3: twice the KV capacity",
        )
        g.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=int,
            default=1,
            help="split the model over N processes (GPUs 0..N-1, or CPU cores); under torchrun, N is its world size",
        )
        g.add_argument(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="prepare the next step on the host while the GPU runs this one (default: on with one CUDA GPU)",
        )
        g.add_argument(
            "--engine-process",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="run the engine core in its own process (default: on for serve, see the README)",
        )
        g.add_argument(
            "--blocked-words",
            metavar="FILE",
            default=None,
            help="phrases (one a line, case-insensitive, Unicode-normalised) that end a completion before "
            "they appear, with finish_reason 'content_filter'",
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)} - {"model"}
        kwargs = {k: v for k, v in vars(ns).items() if k in names}
        model = getattr(ns, "model_flag", None) or getattr(ns, "model", None)
        return cls(model=model, **kwargs)


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
