"""Architecture names (config.json `architectures`) that Ember can run, and the class for each."""

from __future__ import annotations

from ember.errors import ModelLoadError
from ember.model.hf_config import ModelConfig
from ember.model.llama import CausalLM

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",  # its language model; the vision tower is not loaded
    "Qwen3MoeForCausalLM",  # mixtures of experts: ember/model/moe.py
    "MixtralForCausalLM",
    "GptOssForCausalLM",  # attention sinks, biased MoE with a clamped SwiGLU, MXFP4 experts: ember/model/gpt_oss.py
)


def model_class(cfg: ModelConfig, source: str) -> type[CausalLM]:
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            source, f"unsupported architecture {cfg.architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return CausalLM
