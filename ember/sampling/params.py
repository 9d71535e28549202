"""Per-request sampling parameters, named and defaulted as in vLLM so clients can switch freely."""

import copy
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

from ember.sampling.structured import StructuredOutputsParams

# Below this a temperature is treated as zero: dividing logits by it would overflow.
GREEDY_TEMPERATURE_EPS = 1e-5
# Larger top-logprob counts cost a full-vocab top-k per step for little practical use.
MAX_LOGPROBS = 20
# Every integer a request carries must fit a 64-bit signed int: it crosses to the engine core as
# msgpack (which refuses anything past 2**64) and lands in int64 tensors. vLLM bounds `seed` the same way.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1  # token ids and counts: the processor bounds them by the vocabulary or the context
# OpenAI's range for a logit_bias value: -100 bans a token in practice, 100 all but forces it.
MAX_LOGIT_BIAS = 100.0


def _int(name: str, value: object, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    # bool is an int subclass, but True as a count is almost always a caller bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int past float's range
        raise ValueError(
            f"{name} must be finite, got an integer of {int(math.trunc(value)).bit_length()} bits"
        ) from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    Values are validated and normalised on construction (ints/floats coerced,
    stop strings and ids turned into lists, top_k=-1 turned into 0), so the
    engine and sampler can trust every field without re-checking.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # Top-N logprobs of every prompt token after the first (vLLM's name); prefix caching is bypassed for the
    # request so every prompt position is computed.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding (vLLM's name): the output must match a JSON schema, regex, choice or grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # Added to the logits of these token ids before sampling (OpenAI's field), each in [-100, 100].
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output must not contain. The front end tokenizes them into `bad_words_token_ids`
    # (each as given and after a space, as vLLM does) and sends the core only those ids.
    bad_words: list[str] | None = None
    # Token sequences the output must not contain: a sequence's last token is banned wherever the output
    # so far ends with the rest of it (a one-token sequence is banned everywhere). Filled from `bad_words`
    # by the front end; may also be given directly.
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        self.n = _int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")

        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")

        self.top_p = _float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

        self.top_k = _int("top_k", self.top_k, hi=INT32_MAX)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0

        self.min_p = _float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)

        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")

        if self.seed is not None:
            self.seed = _int("seed", self.seed)

        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, hi=INT32_MAX)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

        self.min_tokens = _int("min_tokens", self.min_tokens, hi=INT32_MAX)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must not exceed max_tokens={self.max_tokens}, got {self.min_tokens}")

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _bool("include_stop_str_in_output", self.include_stop_str_in_output)

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                value = _int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
                setattr(self, name, value)

        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")

        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = self._token_id_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (leave it out to allow every token)")
        self.bad_words = self._normalise_bad_words(self.bad_words)
        self.bad_words_token_ids = self._normalise_bad_words_token_ids(self.bad_words_token_ids)

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")
            if not s:
                raise ValueError("stop must not contain empty strings")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {ids!r}")
        return [_int("stop_token_ids", i, 0, INT32_MAX) for i in ids]

    @staticmethod
    def _token_id_list(name: str, ids: object) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"{name} must be a list of token ids, got {ids!r}")
        return [_int(name, i, 0, INT32_MAX) for i in ids]

    @staticmethod
    def _normalise_logit_bias(bias: object) -> dict[int, float] | None:
        """Token id -> bias, ids as ints and biases as floats; empty is None (nothing to add)."""
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise ValueError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
        out = {}
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= int(token) <= INT32_MAX:
                raise ValueError(f"logit_bias keys must be token ids (ints in [0, {INT32_MAX}]), got {token!r}")
            value = _float("logit_bias", value)
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {value} for token {token}"
                )
            out[int(token)] = value
        return out or None

    @staticmethod
    def _normalise_bad_words(words: object) -> list[str] | None:
        if words is None:
            return None
        if not isinstance(words, (list, tuple)):
            raise ValueError(f"bad_words must be a list of strings, got {words!r}")
        for w in words:
            if not isinstance(w, str):
                raise ValueError(f"bad_words must contain only strings, got {w!r}")
            if not w.strip():
                raise ValueError(f"bad_words must not contain empty or blank strings, got {w!r}")
        return list(words) or None

    @staticmethod
    def _normalise_bad_words_token_ids(sequences: object) -> list[list[int]] | None:
        if sequences is None:
            return None
        if not isinstance(sequences, (list, tuple)):
            raise ValueError(f"bad_words_token_ids must be a list of token id lists, got {sequences!r}")
        out = []
        for seq in sequences:
            ids = SamplingParams._token_id_list("bad_words_token_ids", seq)
            if not ids:
                raise ValueError("bad_words_token_ids must not contain empty sequences")
            out.append(ids)
        return out or None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def clone(self) -> "SamplingParams":
        """Deep copy, so the engine can fill in defaults (e.g. max_tokens) without
        mutating an object the caller may reuse across requests."""
        return copy.deepcopy(self)
