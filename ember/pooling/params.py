"""Pooling requests: what one asks for (`PoolingParams`) and how the engine pools (`PoolerConfig`).

No torch here: the front end, the messages and the core import these; the runner's `ember.runner.pooler`
does the arithmetic. Names follow vLLM (`PoolingParams.dimensions`, `normalize`,
`truncate_prompt_tokens`; `pooler_config.pooling_type` LAST / MEAN / CLS). The pooling type is the
engine's, not the request's (as in vLLM): the model was trained with one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' 1_Pooling/config.json flags, in the order they are tried
_ST_MODES = (
    ("pooling_mode_lasttoken", "LAST"),
    ("pooling_mode_mean_tokens", "MEAN"),
    ("pooling_mode_cls_token", "CLS"),
)


POOLING_TASKS = ("embed", "score")


class PoolingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One pooling request's options. `task`: "embed" (a vector) or "score" (one relevance value of a
    (query, document) pair, vLLM's task names); `dimensions`: keep the first N values (Matryoshka), before
    normalizing; `normalize`: None takes the engine's `PoolerConfig.normalize`; `truncate_prompt_tokens`:
    keep the prompt's last N tokens (-1: the context window), done by the front end.

    A score request is scored by the model's kind: a decoder reranker by `score_token_ids` (P(first token)
    at the last position, whatever the engine's pooling type), a cross-encoder by its classifier on the
    first token (sigmoid of its one logit), its pair's second text from `token_type_start` on."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    # a decoder reranker's score (ember/pooling/score.py): softmax over these tokens' logits at the prompt's
    # last position, the first's probability ([true id, false id])
    score_token_ids: list[int] | None = None
    task: str = "embed"
    # a cross-encoder's pair: the prompt position where the second text starts (token type 1 from there)
    token_type_start: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")
        s = self.score_token_ids
        if self.task == "score" and self.dimensions is not None:
            raise ValueError("dimensions: a score request has one value, not an embedding to cut")
        if self.task != "score" and (s is not None or self.token_type_start is not None):
            raise ValueError("score_token_ids and token_type_start belong to score requests (task 'score')")
        t0 = self.token_type_start
        if t0 is not None and (isinstance(t0, bool) or t0 < 1):
            raise ValueError(f"token_type_start must be a positive prompt position, got {t0}")
        if s is not None:
            if len(s) != 2 or s[0] == s[1] or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in s):
                raise ValueError(f"score_token_ids must be two distinct token ids, got {s}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not (t == -1 or t >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {t}")


POOLING_ONLY = "this engine serves embeddings and scores only (--runner pooling); it generates no text"


def task_problem(params: PoolingParams, encoder: bool, num_labels: int) -> str | None:
    """Why the model cannot answer the request's task (None: it can). An embedding model embeds, a
    cross-encoder (an encoder with a one-label classifier) scores by it, a decoder does both, scoring
    through `score_token_ids` (the front ends' ScoreConfig)."""
    if params.task == "embed":
        return "task 'embed': this model is a classifier (a cross-encoder); it scores pairs" if num_labels else None
    if encoder:
        if num_labels != 1:
            return f"task 'score': this encoder has {num_labels} labels; scoring needs a one-label classifier"
        return "score_token_ids: a cross-encoder scores by its classifier" if params.score_token_ids else None
    if params.score_token_ids is None:
        return "score_token_ids: a decoder scores a pair by two tokens' logits (see ScoreConfig)"
    return None


@dataclass(frozen=True)
class PoolerConfig:
    """How the engine pools a prompt's final hidden states (after the final norm) into one vector."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")

    @classmethod
    def parse(cls, value: PoolerConfig | dict[str, Any] | str) -> PoolerConfig:
        """vLLM's forms: the object, a dict, or its JSON (`--pooler-config '{"pooling_type": "MEAN"}'`)."""
        if isinstance(value, PoolerConfig):
            return value
        data = json.loads(value) if isinstance(value, str) else dict(value)
        if not isinstance(data, dict):
            raise ValueError(f"pooler_config must be a JSON object, got {value!r}")
        unknown = set(data) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler_config: unknown fields {sorted(unknown)}")
        kind = str(data.get("pooling_type", "LAST")).upper()
        return cls(pooling_type=kind, normalize=bool(data.get("normalize", True)))

    @property
    def needs_every_token(self) -> bool:
        """Whether a prompt's every position must be computed (MEAN), or its first (CLS): a prefix-cache
        hit would skip them, so such requests take none."""
        return self.pooling_type != "LAST"


def read_sentence_transformers_pooling(model_dir: Path) -> PoolerConfig | None:
    """The pooling a sentence-transformers checkpoint declares (`1_Pooling/config.json`; normalization when
    `modules.json` lists a Normalize module), or None when the directory has no such file."""
    config = model_dir / "1_Pooling" / "config.json"
    if not config.is_file():
        return None
    flags = json.loads(config.read_text())
    kind = next((name for key, name in _ST_MODES if flags.get(key)), None)
    if kind is None:
        raise ValueError(f"{config}: no pooling mode Ember supports (last token, mean or CLS) is set")
    modules = model_dir / "modules.json"
    normalize = True
    if modules.is_file():
        normalize = any(str(m.get("type", "")).endswith("Normalize") for m in json.loads(modules.read_text()))
    return PoolerConfig(kind, normalize)
