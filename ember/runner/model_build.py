"""Building a model on its device from its files: the layers made without PyTorch's random init, the
checkpoint's (or random) weights loaded, quantized where asked, and the loading's garbage returned."""

from __future__ import annotations

import gc
import logging
from contextlib import contextmanager

import torch
from torch import nn

from ember import heap
from ember.model.hf_config import ModelConfig
from ember.model.loader import ModelFiles
from ember.model.registry import Model, model_class

logger = logging.getLogger("ember")


def build_model(
    files: ModelFiles, cfg: ModelConfig, max_model_len: int, dtype: torch.dtype, device: torch.device, seed: int
) -> Model:
    """The model of `files` (its config adjusted to the context, `cfg`), ready for inference. Its rotary
    tables cover `max_model_len` positions, the most a sequence reaches, not the model's own maximum:
    three float32 tables of [positions, head_dim] are 192 MiB and took 0.22 s to compute at 131,072
    positions and head_dim 128 (Llama 3.x, on CPU, 2026-12-05), which `--max-model-len` now cuts."""
    with torch.device(device), _default_dtype(dtype), _skip_weight_init():
        model = model_class(cfg, files.source)(cfg, max_model_len)
    _check_fp8_support(device, files)
    with torch.no_grad():
        if files.weights is None:
            model.init_dummy_weights(seed)
        else:
            model.load_weights(files.weights(), files.source)
        if files.quantize_at_load:
            model.quantize(files.quantization)
    model.eval()
    _return_freed_memory_to_os()
    return model


def _return_freed_memory_to_os() -> None:
    """Loading builds float layers, then replaces them (quantized GGUF, --quantization); glibc keeps the
    freed heap, about 250 MiB of idle RSS for the default model, unless asked to give it back. On CUDA
    the caching allocator keeps them too, and the KV sizing would count them as in use (a GGUF
    Qwen3-30B-A3B's float expert tensors, replaced by quantized ones, are 58 GB)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    heap.trim()


def _check_fp8_support(device: torch.device, files: ModelFiles) -> None:
    """fp8 weights (load-time `fp8` / `ptpc_fp8`, or a checkpoint's own) need fp8 tensor cores on a GPU
    (Ada/Hopper and newer); fp8 KV needs only the fp8 dtype. On CPU fp8 weights run as an exact
    emulation of the GPU's W8A8 arithmetic (what the GPU computes, for measuring quality), slowly."""
    fp8 = files.fp8_weights or (files.quantize_at_load and files.quantization in ("fp8", "ptpc_fp8"))
    if not fp8:
        return
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            f"{files.source}: quantization {files.quantization!r} needs a CUDA GPU with fp8 tensor cores "
            "(compute capability 8.9+, e.g. L4, H100, H200); use int8 or int4 on this device, or "
            "--device cpu"
        )
    if device.type == "cpu":
        logger.warning(
            "quantization %r on CPU is an exact emulation of the GPU's fp8 arithmetic, several times slower than int8",
            files.quantization,
        )


@contextmanager
def _skip_weight_init():
    """Linear and embedding weights start uninitialised: the checkpoint (or the dummy init) fills every
    one, and `load_weights` checks that. PyTorch's random init cost 0.7 s of the default model's load,
    and touching float weights that quantized layers then replace costs resident memory."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
