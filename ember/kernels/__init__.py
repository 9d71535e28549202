"""Triton kernels for the GPU path: paged attention, KV-cache writes, norms, rotary, activation,
quantized matmul, fp8 (W8A8) activation quantization and block-scaled GEMM, fused
mixture-of-experts.

Importing touches no GPU; each function runs on CUDA tensors, or on CPU tensors under
TRITON_INTERPRET=1 (how the tests run without a GPU). Every kernel has a `*_ref` twin in plain
PyTorch with the same signature.
"""

from ember.kernels.activation import silu_and_mul, silu_and_mul_fp8, silu_and_mul_ref
from ember.kernels.decode_attention import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from ember.kernels.fp8_matmul import (
    Fp8MatmulConfig,
    choose_fp8_matmul_config,
    fp8_block_matmul,
    fp8_block_matmul_ref,
    quantize_fp8,
    quantize_fp8_groups,
)
from ember.kernels.fused_moe import fused_moe, fused_moe_from_logits, fused_moe_ref
from ember.kernels.kv_store import store_kv, store_kv_ref
from ember.kernels.moe_align import MoeAlignment, moe_align_block_size, route_and_align
from ember.kernels.moe_config import MoeConfig, choose_moe_config
from ember.kernels.moe_routing import moe_route, moe_route_ref
from ember.kernels.prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from ember.kernels.quant_matmul import (
    QuantMatmulConfig,
    choose_quant_matmul_config,
    dequantize_kernel,
    quant_matmul,
    quant_matmul_ref,
)
from ember.kernels.rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_fp8,
    rms_norm_ref,
)
from ember.kernels.rotary import apply_rotary, apply_rotary_ref
from ember.kernels.rotary_store import rotary_store

__all__ = [
    "Fp8MatmulConfig",
    "MoeAlignment",
    "MoeConfig",
    "QuantMatmulConfig",
    "apply_rotary",
    "apply_rotary_ref",
    "choose_fp8_matmul_config",
    "choose_moe_config",
    "choose_num_splits",
    "choose_quant_matmul_config",
    "dequantize_kernel",
    "fp8_block_matmul",
    "fp8_block_matmul_ref",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "fused_moe",
    "fused_moe_from_logits",
    "fused_moe_ref",
    "moe_align_block_size",
    "moe_route",
    "moe_route_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "quant_matmul",
    "quant_matmul_ref",
    "quantize_fp8",
    "quantize_fp8_groups",
    "rms_norm",
    "rms_norm_fp8",
    "rms_norm_ref",
    "rotary_store",
    "route_and_align",
    "silu_and_mul",
    "silu_and_mul_fp8",
    "silu_and_mul_ref",
    "store_kv",
    "store_kv_ref",
]
