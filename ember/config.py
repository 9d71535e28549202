"""Engine configuration: the user-facing `EngineArgs` and the frozen configs the engine runs on.

`EngineArgs` holds exactly what a user can set (flag names follow vLLM's so users can switch
without rereading docs). It stays in the front end: `EngineArgs.engine_config()` builds the
`EngineConfig` that the engine core is started with (sent to a core process in its bootstrap), and
`EngineArgs.load_config()` the `LoadConfig` the front end reads the tokenizer with. Below the front
end nothing sees `EngineArgs`: each part takes the config it reads. The defaults that depend on the
model's files or the device (`SchedulerConfig`, `RunnerConfig`) are resolved in the core, which reads
the files and imports torch; the front end does neither.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.model.hf_config import ModelConfig
from ember.pooling.params import PoolerConfig
from ember.pooling.score import ScoreConfig

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
RUNNERS = ("auto", "generate", "pooling")
NO_MMPROJ = "none"  # `--no-mmproj`: a GGUF model's language model alone


@dataclass(frozen=True)
class LoadConfig:
    """Which model files to read and how: the core loads the weights with it, the front end the tokenizer."""

    model: str | None  # an HF directory, a .gguf file, or None / DEFAULT_MODEL's name: the default model
    tokenizer: str | None  # a directory with tokenizer.json to use instead of the model's own
    load_format: str  # one of LOAD_FORMATS
    quantization: str | None  # one of QUANTIZATIONS, or None: what the model's files declare
    # a GGUF model's vision projector (llama.cpp's mmproj file); None: the one beside it; NO_MMPROJ: none
    mmproj: str | None = None


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
    # False: a prompt is scheduled whole or waits (an encoder's attention needs all of it in one step)
    chunked_prefill: bool = True
    # Image tokens whose vision-tower outputs one step computes (ember/core/encoder_budget.py)
    max_num_encoder_input_tokens: int | None = None  # None: max_num_batched_tokens
    # False: a prefill chunk never ends inside an image (its tokens attend both ways: Gemma 3)
    split_images: bool = True


@dataclass(frozen=True)
class RunnerConfig:
    """What the model runner needs beyond the model, cache and scheduler configs, resolved."""

    dtype: str  # torch dtype name: float32, float16 or bfloat16
    kv_cache_dtype: str  # "auto" (the model's dtype) or "fp8"
    seed: int
    enforce_eager: bool
    load_format: str = "auto"  # a draft model's weights are read as the target's (random with "dummy")
    pooler: PoolerConfig = PoolerConfig()  # how pooling requests are pooled (resolved: flag, checkpoint, LAST)


@dataclass(frozen=True)
class LoRAConfig:
    """`--enable-lora`'s limits (vLLM's flags): adapters held in device slots at once (and so distinct
    adapters among the running requests), the largest rank a slot takes (smaller ranks are padded with
    zeros), and adapters kept read in host memory (least recently used dropped first)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    lora_dtype: str = "auto"  # the slots' dtype: "auto" (the model's) or a torch dtype name (model/lora.py slot_dtype)


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config`, vLLM's fields. Every method drafts greedily and the target verifies by
    rejection sampling (ember/sampling/rejection.py), so output follows the target's distribution
    whatever the drafts are: greedy output is the same token for token.

    `draft_token_budget` is the rule that turns speculation down as the batch grows: a step carries at
    most that many draft tokens (split evenly over its running requests, none once they alone reach
    it). Verifying costs about one step only while the step is bound by reading the weights; past the
    ridge point it costs compute. None: by device (see `draft_budget_for`)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model: an HF directory or .gguf; eagle3: the EAGLE-3 head's directory
    prompt_lookup_min: int = 2  # ngram: shortest suffix n-gram to look up
    prompt_lookup_max: int = 5  # ngram: longest, tried first
    draft_token_budget: int | None = None

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a dict or its JSON (the CLI's and YAML's form), checked field by field."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a mapping, got {value!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(fields)}")
        if value.get("method") not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {value.get('method')!r}"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        config = cls(**value)
        config.check()
        return config

    def check(self) -> None:
        _check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens, 1)
        _check_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("speculative_config.prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)
        if self.draft_token_budget is not None:
            _check_int("speculative_config.draft_token_budget", self.draft_token_budget, 0)
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model: the ngram method drafts from the prompt, without a model")
        if self.method != "ngram" and not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r}")

    def draft_budget_for(self, device_type: str) -> int:
        """Draft tokens a step may carry. Measured on the H100 (Llama-3.1-8B shape, bf16, 512-token
        contexts, benchmarks/results/spec-decode-gpu-h100-2026-12-05.json): at batch 1 a step verifying
        1 to 8 drafts cost 1.15-1.21 decode steps, but at batch 32 one draft each (64 rows) already cost
        1.44 and four 1.99; so 16 draft tokens, k for a few requests, none from 17 on. On a CPU every
        row costs compute (default model, 2 cores: +~4 ms a row on a 10 ms step), so 8."""
        if self.draft_token_budget is not None:
            return self.draft_token_budget
        return 16 if device_type == "cuda" else 8

    @property
    def needs_draft_model(self) -> bool:
        return self.method != "ngram"


@dataclass(frozen=True)
class EngineConfig:
    """What the engine core is started with: the user's engine flags less the front end's own, checked
    and grouped by who reads them. What depends on the model or the device is resolved by the core
    (`scheduler_config`, `runner_config`), as is the device itself."""

    load: LoadConfig
    cache: CacheConfig
    device: str  # "auto", "cpu", "cuda" or "cuda:N" (ember/runner/device.py resolves it)
    tensor_parallel_size: int
    async_scheduling: bool | None  # None: on for one CUDA GPU (see EngineCore)
    max_num_seqs: int
    max_num_batched_tokens: int | None  # None: by device
    max_model_len: int | None  # None: the model's
    dtype: str  # "auto" (by device and checkpoint) or a torch dtype name: float32, float16 or bfloat16
    kv_cache_dtype: str  # "auto" (the model's dtype) or "fp8"
    seed: int
    enforce_eager: bool
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None  # None: LoRA off (`--enable-lora` not given)
    pooler: PoolerConfig | None = None  # None: the checkpoint's 1_Pooling/config.json, else LAST (EngineCore)
    runner: str = "auto"  # "generate", "pooling" or "auto" (by the model: EngineCore resolves it)
    max_num_encoder_input_tokens: int | None = None  # None: the step's token budget

    def resolved_runner(self, model_config: ModelConfig) -> str:
        """ "pooling" or "generate": an encoder only pools, and is refused anything that generates."""
        if model_config.encoder is None:
            return "pooling" if self.runner == "pooling" else "generate"
        if self.runner == "generate":
            raise ValueError(
                f"runner 'generate': {model_config.architecture} is an encoder; it only pools (--runner pooling)"
            )
        for flag, on in (
            ("tensor_parallel_size", self.tensor_parallel_size > 1),
            ("enable_lora", self.lora is not None),
            ("speculative_config", self.speculative is not None),
        ):
            if on:
                raise ValueError(f"{flag}: not supported for encoder models ({model_config.architecture})")
        return "pooling"

    def runner_config(self, device: torch.device, checkpoint_dtype: str | None) -> RunnerConfig:
        """bf16 on GPUs by default, float32 on CPU where bf16 matmuls are slow on most CPUs."""
        if self.dtype != "auto":
            dtype = self.dtype
        elif device.type == "cpu":
            dtype = "float32"
        else:
            dtype = checkpoint_dtype if checkpoint_dtype in ("float16", "bfloat16") else "bfloat16"
        return RunnerConfig(
            dtype=dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            load_format=self.load.load_format,
        )

    def scheduler_config(self, model_config: ModelConfig, device: torch.device) -> SchedulerConfig:
        """An encoder's prompts are never split, so its step budget holds the longest one (vLLM's rule
        without chunked prefill)."""
        max_len = self.max_model_len or model_config.max_position_embeddings
        budget = self.max_num_batched_tokens or (8192 if device.type == "cuda" else 2048)
        encoder = model_config.encoder is not None
        if encoder and max_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_len} is more than the encoder's {model_config.max_position_embeddings} "
                "learned positions"
            )
        if encoder and budget < max_len:
            if self.max_num_batched_tokens is not None:
                raise ValueError(
                    f"max_num_batched_tokens {budget} is less than max_model_len {max_len}: an encoder's prompt "
                    "is never split across steps"
                )
            budget = max_len
        vision = model_config.vision
        return SchedulerConfig(
            self.max_num_seqs,
            budget,
            max_len,
            chunked_prefill=not encoder,
            max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
            split_images=vision is None or not vision.bidirectional_images,
        )


@dataclass
class EngineArgs:
    """Everything a user can configure; names match vLLM's `EngineArgs` / CLI flags."""

    model: str | None = None
    tokenizer: str | None = None
    # llama.cpp's --mmproj: the vision projector GGUF of a GGUF model (Gemma 3); None: the one *mmproj*.gguf
    # beside the model file, if there is exactly one; "none": text only (docs/multimodal.md)
    mmproj: str | None = None
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
    # vLLM's SchedulerConfig field: image tokens whose tower outputs one step computes (None: the step's
    # token budget; an image longer than it is encoded alone in its step; docs/multimodal.md)
    max_num_encoder_input_tokens: int | None = None
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
    # Draft tokens verified by the model (vLLM's form: a dict, or its JSON; see SpeculativeConfig).
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # LoRA adapters per request (docs/lora.md): slots on the device, their rank, adapters kept in host memory
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_dtype: str = "auto"  # the adapters' dtype in their slots: "auto" (the model's), float32, bfloat16, float16
    # vLLM's --runner: "generate", "pooling" (embeddings and scores only), or "auto" (pooling for an encoder
    # model, else generate; a generating engine serves pooling requests too). See docs/pooling.md.
    runner: str = "auto"
    # How embedding requests pool (vLLM's form: a PoolerConfig, a dict or its JSON; see docs/pooling.md).
    pooler_config: PoolerConfig | dict[str, Any] | str | None = None
    # How score / rerank requests prompt a decoder reranker (the front end's; a ScoreConfig, a dict or its
    # JSON; None: Qwen3-Reranker's template and its "yes" / "no" tokens; see docs/pooling.md).
    score_config: ScoreConfig | dict[str, Any] | str | None = None
    # Where a request's images may come from (docs/multimodal.md): file:// URLs only under this directory
    # ("" as in vLLM: none), http(s) URLs only from these hosts (None: any); and how many per prompt
    # (vLLM's form: {"image": N}, or its JSON).
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None
    limit_mm_per_prompt: dict[str, int] | str | None = None

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
        if self.max_num_encoder_input_tokens is not None:
            _check_int("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens, 1)
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
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
            if self.tensor_parallel_size > 1:
                raise ValueError("speculative_config: not supported with tensor parallelism (tensor_parallel_size > 1)")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.pooler_config is not None:
            self.pooler_config = PoolerConfig.parse(self.pooler_config)
        self.score_config = ScoreConfig.parse(self.score_config) if self.score_config is not None else ScoreConfig()
        _check_int("max_loras", self.max_loras, 1)
        _check_int("max_lora_rank", self.max_lora_rank, 1)
        if self.max_cpu_loras is not None:
            _check_int("max_cpu_loras", self.max_cpu_loras, self.max_loras)
        if self.lora_dtype != "auto" and self.lora_dtype not in _DTYPES:
            raise ValueError(f"lora_dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.lora_dtype!r}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora: not supported with tensor parallelism yet (tensor_parallel_size > 1)")
        if self.enable_lora and self.speculative_config is not None:
            raise ValueError("enable_lora: not supported with speculative decoding yet (speculative_config)")
        if isinstance(self.limit_mm_per_prompt, str):
            self.limit_mm_per_prompt = json.loads(self.limit_mm_per_prompt)
        if self.limit_mm_per_prompt is not None:
            if not isinstance(self.limit_mm_per_prompt, dict) or set(self.limit_mm_per_prompt) - {"image"}:
                raise ValueError(f'limit_mm_per_prompt must be {{"image": N}}, got {self.limit_mm_per_prompt!r}')
            _check_int("limit_mm_per_prompt.image", self.limit_mm_per_prompt.get("image", 0), 0)

    def engine_config(self) -> EngineConfig:
        """The engine core's part of the flags, dtype names spelled one way; the front end keeps the rest
        (chat template, served model name, blocked words, whether the core gets its own process)."""
        return EngineConfig(
            load=self.load_config(),
            cache=self.cache_config(),
            device=self.device,
            tensor_parallel_size=self.tensor_parallel_size,
            async_scheduling=self.async_scheduling,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            dtype="auto" if self.dtype == "auto" else _DTYPES[self.dtype],
            kv_cache_dtype="auto" if self.kv_cache_dtype == "auto" else "fp8",
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            speculative=SpeculativeConfig.parse(self.speculative_config) if self.speculative_config else None,
            lora=self.lora_config(),
            pooler=PoolerConfig.parse(self.pooler_config) if self.pooler_config is not None else None,
            runner=self.runner,
            max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
        )

    def lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        dtype = "auto" if self.lora_dtype == "auto" else _DTYPES[self.lora_dtype]
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras, dtype)

    def load_config(self) -> LoadConfig:
        return LoadConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            load_format=self.load_format,
            quantization=self.quantization,
            mmproj=self.mmproj,
        )

    def cache_config(self) -> CacheConfig:
        kv_bytes = None if self.kv_cache_memory is None else int(self.kv_cache_memory * (1 << 30))
        return CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_bytes,
        )

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
            "--mmproj",
            metavar="FILE",
            default=None,
            help="a GGUF model's vision projector, as llama.cpp's (Gemma 3; default: the one *mmproj*.gguf "
            "beside the model file)",
        )
        g.add_argument(
            "--no-mmproj",
            dest="mmproj",
            action="store_const",
            const=NO_MMPROJ,
            help="load a GGUF model's language model alone, without the projector beside it",
        )
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
        g.add_argument(
            "--max-num-encoder-input-tokens",
            type=int,
            default=None,
            help="image tokens whose vision-tower outputs one step computes (default: --max-num-batched-tokens; "
            "a larger image is encoded alone)",
        )
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
            help="'fp8' stores keys and values (MLA: the latent rows) as float8 e4m3: twice the KV capacity",
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
        g.add_argument(
            "--speculative-config",
            metavar="JSON",
            default=None,
            help='speculative decoding, as vLLM: e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\', '
            "'draft_model' or 'eagle3' with \"model\": a path (see docs/speculative_decoding.md)",
        )

        g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters per request (docs/lora.md)")
        g.add_argument("--max-loras", type=int, default=1, help="LoRA adapters on the device at once")
        g.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank served")
        g.add_argument(
            "--max-cpu-loras", type=int, default=None, help="LoRA adapters kept in host memory (default: --max-loras)"
        )
        g.add_argument(
            "--lora-dtype",
            default="auto",
            help="the adapters' dtype on the device: auto (the model's), float32, bfloat16 or float16; on CPU "
            "bfloat16 holds them in half the memory (docs/lora.md)",
        )
        g.add_argument(
            "--runner",
            choices=RUNNERS,
            default="auto",
            help="pooling: serve embeddings and scores only; auto: pooling for an encoder model (BERT, XLM-R), "
            "else generate (which also serves embeddings; see docs/pooling.md)",
        )
        g.add_argument(
            "--pooler-config",
            metavar="JSON",
            default=None,
            help='how /v1/embeddings pools, as vLLM: e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
            "(default: the checkpoint's 1_Pooling/config.json, else LAST; see docs/pooling.md)",
        )
        g.add_argument(
            "--score-config",
            metavar="JSON",
            default=None,
            help='how /v1/score and /rerank prompt a decoder reranker: e.g. \'{"instruction": "...", "true_token": '
            '"yes", "false_token": "no"}\' (default: Qwen3-Reranker\'s template; see docs/pooling.md)',
        )

        g.add_argument(
            "--allowed-local-media-path",
            default="",
            metavar="DIR",
            help="let requests' file:// image URLs read files under DIR (default: none are read)",
        )
        g.add_argument(
            "--allowed-media-domains",
            nargs="+",
            default=None,
            metavar="HOST",
            help="fetch requests' http(s) image URLs only from these hosts (default: any)",
        )
        g.add_argument(
            "--limit-mm-per-prompt",
            metavar="JSON",
            default=None,
            help="images one prompt may carry, as vLLM: '{\"image\": 4}' (default: 8)",
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)} - {"model"}
        kwargs = {k: v for k, v in vars(ns).items() if k in names}
        model = getattr(ns, "model_flag", None) or getattr(ns, "model", None)
        return cls(model=model, **kwargs)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
