"""How a (query, document) pair becomes a score request, for both kinds of reranker. No torch here: the
front ends build the prompts (`score_requests`); the runner's pooler (`ember.runner.pooler`) scores them.

A cross-encoder (BERT / XLM-R `*ForSequenceClassification`) reads the pair as its tokenizer joins two texts
(`[CLS] q [SEP] d [SEP]`, `<s> q </s></s> d </s>`), the second text's tokens of type 1; its score is the
sigmoid of its classifier's logit. A decoder reranker (Qwen3-Reranker style) reads one prompt made from a
template, and its score is P(true token) = softmax(the two tokens' logits)[0] at the prompt's last
position, from the LM head's two rows only.

The template is Qwen3-Reranker's documented one (its model card): a system turn that asks for "yes" or
"no", the user turn `<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {doc}`, and an
assistant turn opened with an empty think block. It lives here and nowhere else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Protocol

from ember.pooling.params import PoolingParams

QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
QWEN3_RERANKER_PAIR = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class _Vocab(Protocol):
    def token_to_id(self, token: str) -> int | None: ...


class _Tokenizer(Protocol):
    @property
    def tok(self) -> _Vocab: ...

    def encode_pair(self, first: str, second: str) -> tuple[list[int], int | None]: ...


@dataclass(frozen=True)
class ScoreConfig:
    """How `LLM.score`, `/v1/score` and `/rerank` prompt the model and read its answer. `true_token` /
    `false_token`: the tokens whose logits are compared (a token string of the vocabulary, or an id);
    `instruction`: the default `{instruction}` (a request may give its own); `prefix` + `pair` + `suffix`:
    the prompt, `pair` with `{instruction}`, `{query}` and `{doc}`."""

    instruction: str = DEFAULT_INSTRUCTION
    true_token: str | int = "yes"
    false_token: str | int = "no"
    prefix: str = QWEN3_RERANKER_PREFIX
    pair: str = QWEN3_RERANKER_PAIR
    suffix: str = QWEN3_RERANKER_SUFFIX

    def __post_init__(self) -> None:
        for name in ("true_token", "false_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (str, int)) or (isinstance(value, int) and value < 0):
                raise ValueError(f"score_config.{name} must be a token string or a token id >= 0, got {value!r}")
        if self.true_token == self.false_token:
            raise ValueError(f"score_config: true_token and false_token are the same ({self.true_token!r})")

    @classmethod
    def parse(cls, value: ScoreConfig | dict[str, Any] | str) -> ScoreConfig:
        """The object, a dict, or its JSON (`--score-config '{"instruction": "..."}'`)."""
        if isinstance(value, ScoreConfig):
            return value
        data = json.loads(value) if isinstance(value, str) else value
        if not isinstance(data, dict):
            raise ValueError(f"score_config must be a JSON object, got {value!r}")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"score_config: unknown fields {sorted(unknown)}")
        return cls(**data)

    def prompt(self, query: str, doc: str, instruction: str | None = None) -> str:
        """The whole prompt of one pair (tokenized as one text: the template's joins fall on special tokens
        and newlines, so it tokenizes as Qwen3-Reranker's prefix, pair and suffix tokenized apart)."""
        instruction = self.instruction if instruction is None else instruction
        body = self.pair.format(instruction=instruction, query=query, doc=doc)
        return self.prefix + body + self.suffix

    def token_ids(self, vocab: _Vocab, vocab_size: int) -> list[int]:
        """[true id, false id], strings looked up in the vocabulary as one token each."""
        ids = []
        for name in ("true_token", "false_token"):
            value = getattr(self, name)
            tid = vocab.token_to_id(value) if isinstance(value, str) else value
            if tid is None:
                raise ValueError(f"score_config.{name}: {value!r} is not one token of this model's vocabulary")
            if tid >= vocab_size:
                raise ValueError(f"score_config.{name}: token id {tid} is outside the vocabulary ({vocab_size})")
            ids.append(tid)
        return ids


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against each text_2 (1:1, 1:N), or text_1[i] with text_2[i] (N:N). A
    ValueError naming the field when they do not pair or a list is empty."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in (("text_1", first), ("text_2", second)):
        if not texts:
            raise ValueError(f"{name} must not be empty")
        if not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{name} must be a string or a list of strings")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise ValueError(
            f"text_2: {len(second)} texts do not pair with text_1's {len(first)} "
            "(give one text_1, or as many as text_2)"
        )
    return list(zip(first, second))


def score_requests(
    pairs: list[tuple[str, str]],
    tokenizer: _Tokenizer,
    config: ScoreConfig,
    encoder: bool,
    vocab_size: int,
    instruction: str | None = None,
) -> list[tuple[str | dict[str, list[int]], PoolingParams]]:
    """One (prompt, params) per pair: an encoder's (a cross-encoder) the tokenized pair, a decoder's the
    template's text. A ValueError names what does not fit (a score_config token outside the vocabulary)."""
    if encoder:
        requests: list[tuple[str | dict[str, list[int]], PoolingParams]] = []
        for query, doc in pairs:
            ids, second = tokenizer.encode_pair(query, doc)
            requests.append(({"prompt_token_ids": ids}, PoolingParams(task="score", token_type_start=second)))
        return requests
    params = PoolingParams(task="score", score_token_ids=config.token_ids(tokenizer.tok, vocab_size))
    return [(config.prompt(query, doc, instruction), params) for query, doc in pairs]
