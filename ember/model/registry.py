"""Architecture names (config.json `architectures`) that Ember can run, and the class for each."""

from __future__ import annotations

from ember.errors import ModelLoadError
from ember.model.bert import EncoderModel
from ember.model.hf_config import DEEPSEEK_ARCHITECTURES, ENCODER_ARCHITECTURES, ModelConfig
from ember.model.llama import CausalLM
from ember.model.qwen3_next import ARCHITECTURE as QWEN3_NEXT
from ember.model.qwen3_next import Qwen3NextForCausalLM

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",  # with its SigLIP tower: ember/model/siglip.py
    "Qwen2_5_VLForConditionalGeneration",  # Qwen2 with M-RoPE and its ViT: ember/model/qwen2_5_vl.py
    "Qwen3MoeForCausalLM",  # mixtures of experts: ember/model/moe.py
    "MixtralForCausalLM",
    QWEN3_NEXT,  # hybrid: Gated DeltaNet linear attention and gated full attention, shared-expert MoE
    "GptOssForCausalLM",  # attention sinks, biased MoE with a clamped SwiGLU, MXFP4 experts: ember/model/gpt_oss.py
    "Llama4ForCausalLM",  # chunked local + NoPE global attention, shared-expert MoE: ember/model/llama4.py
    "Llama4ForConditionalGeneration",  # its language model; the vision tower is not loaded
    *DEEPSEEK_ARCHITECTURES,  # multi-head latent attention (ember/model/mla.py), grouped-routing MoE
    *ENCODER_ARCHITECTURES,  # BERT, RoBERTa, XLM-R encoders and cross-encoders: ember/model/bert.py
)

# What the runner holds: a decoder generates (and pools); an encoder only pools.
Model = CausalLM | EncoderModel


def model_class(cfg: ModelConfig, source: str) -> type[CausalLM] | type[EncoderModel]:
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            source, f"unsupported architecture {cfg.architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if cfg.encoder is not None:
        return EncoderModel
    return Qwen3NextForCausalLM if cfg.architecture == QWEN3_NEXT else CausalLM
