"""Read a model's config and weights for the engine core, without `transformers`.

The tokenizer and sampling defaults are the front end's business (`ember.model.files`); the core
sees token ids only, and builds the tokenizer only for its first structured-output request, from
what this module read (`ModelFiles.model_info`): each file is parsed once per process.

The GGUF loader (ember.model.gguf, ember.model.gguf_mmproj) is imported for a GGUF model only, as
ember.model.files imports the GGUF reader: together 46 ms of the engine core's imports for an HF model
(median of 3, 2-core EPYC, 2026-12-07).
"""

from __future__ import annotations

import functools
import glob
import itertools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ember.config import LoadConfig
from ember.errors import ModelLoadError
from ember.model.files import (
    ModelInfo,
    gguf_info,
    hf_info,
    mmproj_errors,
    mmproj_path,
    model_path,
    read_config,
    read_json,
)
from ember.model.hf_config import ModelConfig
from ember.model.registry import model_class
from ember.model.sharding import WeightValue
from ember.pooling.params import PoolerConfig, read_sentence_transformers_pooling
from ember.quant.checkpoints import METHODS, checkpoint_format, quantized_weights
from ember.quant.checkpoints.base import CheckpointFormat
from ember.quant.quantize import QUANTIZERS

logger = logging.getLogger("ember")

WeightIterator = Iterator[tuple[str, WeightValue]]


@dataclass
class ModelFiles:
    source: str
    model_config: ModelConfig
    checkpoint_dtype: str | None
    model_info: Callable[[], ModelInfo]  # the front end's facts (the tokenizer), built from what was read here
    weights: Callable[[], WeightIterator] | None = None  # None: random weights (--load-format dummy)
    quantization: str = "none"  # resolved: "none", "gguf" (weights arrive quantized), or a mode to apply
    prequantized: bool = False  # an HF checkpoint's quantization_config (quantization names its method)
    fp8_weights: bool = False  # weights arrive as fp8 (on a GPU they need fp8 tensor cores; the CPU expands them)
    # the pooling the checkpoint declares: sentence-transformers' 1_Pooling beside an HF directory's weights,
    # a GGUF file's pooling_type (which llama.cpp's converter takes from the same module)
    pooler: PoolerConfig | None = None

    @property
    def quantize_at_load(self) -> bool:
        """Whether the runner quantizes dense weights itself (`--quantization int8|int4|fp8`)."""
        return self.quantization in QUANTIZERS and not self.prequantized


def load_model_files(load: LoadConfig) -> ModelFiles:
    path, is_gguf = model_path(load)
    if is_gguf:
        quantization = load.quantization or "gguf"
        files = _gguf_files(load, path, keep_quantized=quantization == "gguf")
    else:
        files = _hf_files(load, path)
        quantization = _hf_quantization(load.quantization, files, path)
    files.quantization = quantization
    return files


def _hf_quantization(requested: str | None, files: ModelFiles, path: str) -> str:
    """The checkpoint's own method when config.json declares one (an explicit --quantization must name
    the same), else the requested load-time mode."""
    if files.prequantized:
        if requested not in (None, files.quantization):
            raise ValueError(
                f"quantization {requested!r} conflicts with the checkpoint's quantization_config."
                f"quant_method {files.quantization!r} ({os.path.join(path, 'config.json')}); omit "
                "--quantization to load it as stored"
            )
        return files.quantization
    if requested == "gguf":
        raise ValueError(
            f"quantization 'gguf' needs a .gguf model file; use int8, int4 or fp8 to quantize {path} at load"
        )
    if requested in METHODS and requested not in QUANTIZERS:
        raise ValueError(
            f"quantization {requested!r} needs a checkpoint stored that way ({path} has no "
            "quantization_config in config.json); use int8, int4 or fp8 to quantize it at load"
        )
    return requested or "none"


def _gguf_files(load: LoadConfig, path: str, keep_quantized: bool) -> ModelFiles:
    """A GGUF language model, with its vision projector (llama.cpp's mmproj file) where there is one: the
    pair configured and named as transformers' Gemma3ForConditionalGeneration or Qwen2_5_VLForConditionalGeneration."""
    from ember.model.gguf import load_gguf  # GGUF models only: see the module docstring
    from ember.model.gguf_mmproj import load_mmproj, multimodal_config

    g, dummy = load_gguf(path), load.load_format == "dummy"
    pooling_type = g.hf_config.get("ember_pooling_type")
    mmproj = mmproj_path(load, path, g.hf_config["model_type"])
    proj, hf_config = None, g.hf_config
    if mmproj is not None:
        with mmproj_errors(load, path):
            proj = load_mmproj(mmproj)
            hf_config = multimodal_config(g.hf_config, g.vocab.tokens, path, proj)
        logger.info("%s: vision projector %s", os.path.basename(path), mmproj)

    def weights() -> WeightIterator:
        text = (
            (name, torch.from_numpy(t) if isinstance(t, np.ndarray) else t)
            for name, t in g.tensors(keep_quantized=keep_quantized)
        )
        vision = ((name, torch.from_numpy(t)) for name, t in (proj.tensors() if proj is not None else ()))
        return itertools.chain(text, vision)

    return ModelFiles(
        source=path,
        model_config=_model_config(hf_config, path),
        checkpoint_dtype=None,
        model_info=functools.partial(gguf_info, load, g.vocab, None if proj is None else proj.image_processor),
        weights=None if dummy else weights,
        pooler=PoolerConfig(pooling_type) if pooling_type else None,
    )


def _hf_files(load: LoadConfig, path: str) -> ModelFiles:
    config_file = os.path.join(path, "config.json")
    cfg = read_config(path)
    weights = None if load.load_format == "dummy" else safetensors_weights(path)
    fmt = checkpoint_format(cfg, config_file)
    if fmt is not None and weights is not None:
        weights = _assembled(weights, fmt, path)
    return ModelFiles(
        source=path,
        model_config=_model_config(cfg, config_file),
        checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        model_info=functools.partial(hf_info, load, path, cfg),
        weights=weights,
        quantization=fmt.method if fmt is not None else "none",
        prequantized=fmt is not None,
        fp8_weights=fmt is not None and fmt.fp8,
        pooler=read_sentence_transformers_pooling(Path(path)),
    )


def _assembled(weights: Callable[[], WeightIterator], fmt: CheckpointFormat, path: str) -> Callable[[], WeightIterator]:
    return lambda: quantized_weights(weights(), fmt, path)


def _model_config(cfg: dict[str, Any], source: str) -> ModelConfig:
    try:
        model_config = ModelConfig.from_hf_config(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(source, f"incomplete model config ({e!r} missing or invalid)") from e
    model_class(model_config, source)
    return model_config


def safetensors_weights(path: str) -> Callable[[], WeightIterator]:
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        index = read_json(index_file) or {}
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(index_file, "no 'weight_map' in the safetensors index")
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(os.path.basename(f) for f in glob.glob(os.path.join(path, "*.safetensors")))
    if not shards:
        raise ModelLoadError(path, "no *.safetensors weights found (use --load-format dummy for random weights)")
    files = [os.path.join(path, s) for s in shards]
    for f in files:
        if not os.path.isfile(f):
            raise ModelLoadError(f, "file not found (listed in the safetensors index)")

    def iterate() -> WeightIterator:
        for f in files:
            try:
                with safe_open(f, framework="pt") as st:
                    for name in st.keys():
                        yield name, _LazyTensor(st.get_slice(name))
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(f, f"corrupt or unreadable safetensors file ({e})") from e

    return iterate


class _LazyTensor:
    """A safetensors tensor not read yet: a tensor-parallel rank reads only its slice of it."""

    def __init__(self, st_slice: Any) -> None:
        self._slice = st_slice
        self.shape = tuple(st_slice.get_shape())
        self.dtype: str = st_slice.get_dtype()  # safetensors' name, e.g. "F8_E4M3"

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._slice[(slice(None),) * dim + (slice(start, start + length),)]

    def load(self) -> torch.Tensor:
        return self._slice[:]
