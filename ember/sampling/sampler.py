"""Batched token sampling: allowed tokens, bad words, min_tokens, logit bias, penalties, temperature,
min-p/top-k/top-p, greedy and seeded draws, in vLLM v1's order.

Everything runs on the logits' device as whole-batch tensor ops; the only Python loop there is over
seeded rows, because each one owns its generator. What varies per row is gathered into per-step
tensors once per step by `SamplingBatch.build`, on the host.
"""

from dataclasses import dataclass

import numpy as np
import torch

from ember.cpu_native import ops as native
from ember.sampling.params import SamplingParams
from ember.transfer import array_to_device, to_device


@dataclass
class Penalties:
    """What the penalty step needs; absent from a batch in which every row uses the defaults."""

    presence: torch.Tensor  # [N] float32
    frequency: torch.Tensor  # [N] float32
    repetition: torch.Tensor  # [N] float32
    output_token_ids: torch.Tensor  # [N, max_output_len] int64, padded with vocab_size
    # [N, max_prompt_len] int64, padded with vocab_size; None when no row has a
    # repetition penalty, since only that penalty looks at the prompt.
    prompt_token_ids: torch.Tensor | None


@dataclass
class SamplingBatch:
    """Per-row tensors for one step, built once per step by the model runner.

    Optional tensors are None when no row needs that stage, so the sampler can
    skip it (notably the full-vocab sort behind top-k/top-p).
    """

    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor  # [N] bool
    # [N] float32; greedy rows hold 1.0. None when every random row uses 1.0.
    temperature: torch.Tensor | None
    top_k: torch.Tensor | None  # [N] int64; disabled rows hold vocab_size
    top_p: torch.Tensor | None  # [N] float32; disabled rows hold 1.0
    min_p: torch.Tensor | None  # [N] float32; disabled rows hold 0.0
    generators: dict[int, torch.Generator]  # random rows that draw with their own generator
    penalties: Penalties | None
    # (row indices, token ids) to set to -inf because the row has not reached min_tokens.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    max_num_logprobs: int | None  # None when no row asked for logprobs
    # (row indices [R], [R, V] bool True where banned): the rows with allowed_token_ids and, per row,
    # every token outside them.
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    # (row indices, token ids) to set to -inf this step: one-token bad words, and the last token of each
    # longer bad word whose other tokens end the row's output so far.
    bad_words_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # (row indices, token ids, biases float32) to add to the logits: the rows' logit_bias entries.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Some row has a bad word of several tokens: `bad_words_mask` depends on the output so far.
    bad_words_per_step: bool = False
    # [N, ceil(V / 32)] int32: bit j of word i allows token 32 * i + j (grammar masks; all ones for free rows).
    # Set by the model runner after the forward is queued, since it is computed meanwhile.
    token_bitmask: torch.Tensor | None = None

    @property
    def mask_can_wait(self) -> bool:
        """No row filters by probability, so a grammar mask may be applied after the rest of sampling."""
        return self.top_k is None and self.top_p is None and self.min_p is None

    @property
    def one_pass(self) -> bool:
        """On a GPU every row may be drawn by the fused kernel (`ember.kernels.sampling`): no row filters by
        probability and none draws from its own generator."""
        return not self.all_greedy and not self.generators and self.mask_can_wait

    @property
    def transforms_logits(self) -> bool:
        """Some row's logits change before sampling (`_processed`: allowed tokens, bad words, min_tokens,
        logit_bias, penalties), which is done in float32, in place."""
        return not (
            self.penalties is None
            and self.min_tokens_mask is None
            and self.allowed_token_ids is None
            and self.bad_words_mask is None
            and self.logit_bias is None
        )

    @property
    def argmax_only(self) -> bool:
        """Every row takes its largest raw logit and reports nothing else: the logits themselves are not needed."""
        return (
            self.all_greedy
            and not self.transforms_logits
            and self.max_num_logprobs is None
            and self.token_bitmask is None
        )

    @property
    def reusable(self) -> bool:
        """The next step of the same rows may sample with these tensors again: none of them depends on
        the output so far (penalties count it, min_tokens holds EOS back until it is long enough, bad
        words of several tokens look at its end). Static ones (temperature, logit_bias, allowed tokens,
        one-token bad words) never change during a request."""
        return self.penalties is None and self.min_tokens_mask is None and not self.bad_words_per_step

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        num_output_tokens: list[int],
        generators: list[torch.Generator | None],
        eos_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
    ) -> "SamplingBatch":
        """Lists are indexed by batch row.

        `num_output_tokens` counts tokens sampled so far, including any still on the device under
        async scheduling (`output_token_ids` then lacks them, which only rows without penalties or
        bad words of several tokens may do: `Request.needs_host_tokens`). A random row is seeded iff
        its generator is given; the engine creates it from params.seed on the logits' device and
        keeps it across steps so a request's draws continue one stream. Generators of greedy rows
        are ignored.
        """
        num_rows = len(params)
        for name, values in (
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
            ("num_output_tokens", num_output_tokens),
            ("generators", generators),
            ("eos_token_ids", eos_token_ids),
        ):
            if len(values) != num_rows:
                raise ValueError(f"{name} has {len(values)} rows, expected {num_rows}")

        greedy = [p.is_greedy for p in params]
        random_params = [p for p, g in zip(params, greedy) if not g]

        def per_row(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device)

        temperature = None
        if any(p.temperature != 1.0 for p in random_params):
            temperature = per_row([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32)

        top_k = None
        if any(0 < p.top_k < vocab_size for p in random_params):
            top_k = per_row(
                [vocab_size if g or p.top_k == 0 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)],
                torch.int64,
            )

        top_p = None
        if any(p.top_p < 1.0 for p in random_params):
            top_p = per_row([1.0 if g else p.top_p for p, g in zip(params, greedy)], torch.float32)

        min_p = None
        if any(p.min_p > 0.0 for p in random_params):
            min_p = per_row([0.0 if g else p.min_p for p, g in zip(params, greedy)], torch.float32)

        penalties = None
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0 for p in params):
            needs_prompt = any(p.repetition_penalty != 1.0 for p in params)
            penalties = Penalties(
                presence=per_row([p.presence_penalty for p in params], torch.float32),
                frequency=per_row([p.frequency_penalty for p in params], torch.float32),
                repetition=per_row([p.repetition_penalty for p in params], torch.float32),
                output_token_ids=_pad_token_ids(output_token_ids, vocab_size, device),
                prompt_token_ids=(_pad_token_ids(prompt_token_ids, vocab_size, device) if needs_prompt else None),
            )

        mask_rows: list[int] = []
        mask_ids: list[int] = []
        for row, (p, count, eos) in enumerate(zip(params, num_output_tokens, eos_token_ids)):
            if count >= p.min_tokens:
                continue
            # As in vLLM, ignore_eos lets EOS be generated freely, so it is only
            # held back for requests that would otherwise stop on it.
            assert p.stop_token_ids is not None  # SamplingParams.__post_init__ normalises it to a list
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
            banned_in_vocab = sorted(t for t in banned if t < vocab_size)
            mask_rows.extend([row] * len(banned_in_vocab))
            mask_ids.extend(banned_in_vocab)
        min_tokens_mask = None
        if mask_rows:
            min_tokens_mask = (per_row(mask_rows, torch.int64), per_row(mask_ids, torch.int64))

        allowed_token_ids = None
        allowed_rows = [row for row, p in enumerate(params) if p.allowed_token_ids]
        if allowed_rows:
            # One scatter clears the allowed ids of an all-banned mask; padding lands in a scratch column.
            padded = _pad_token_ids([params[row].allowed_token_ids or [] for row in allowed_rows], vocab_size, device)
            outside = torch.ones(len(allowed_rows), vocab_size + 1, dtype=torch.bool, device=device)
            outside.scatter_(1, padded.clamp_(max=vocab_size), False)
            allowed_token_ids = (per_row(allowed_rows, torch.int64), outside[:, :vocab_size])

        bad_rows: list[int] = []
        bad_ids: list[int] = []
        bad_words_per_step = False
        for row, (p, out, count) in enumerate(zip(params, output_token_ids, num_output_tokens)):
            if not p.bad_words_token_ids:
                continue
            banned_ids = set()
            for seq in p.bad_words_token_ids:
                if len(seq) == 1:
                    banned_ids.add(seq[0])
                    continue
                bad_words_per_step = True
                if len(out) != count:
                    raise ValueError(
                        f"row {row}: a bad word of several tokens needs every output token on the host "
                        f"({len(out)} of {count})"
                    )
                prefix = len(seq) - 1
                if len(out) >= prefix and out[len(out) - prefix :] == seq[:prefix]:
                    banned_ids.add(seq[-1])
            banned_in_vocab = sorted(t for t in banned_ids if t < vocab_size)
            bad_rows.extend([row] * len(banned_in_vocab))
            bad_ids.extend(banned_in_vocab)
        bad_words_mask = None
        if bad_rows:
            bad_words_mask = (per_row(bad_rows, torch.int64), per_row(bad_ids, torch.int64))

        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for row, p in enumerate(params):
            for token, bias in (p.logit_bias or {}).items():
                if token < vocab_size:
                    bias_rows.append(row)
                    bias_ids.append(token)
                    bias_values.append(bias)
        logit_bias = None
        if bias_rows:
            logit_bias = (
                per_row(bias_rows, torch.int64),
                per_row(bias_ids, torch.int64),
                per_row(bias_values, torch.float32),
            )

        requested = [p.logprobs for p in params if p.logprobs is not None]

        return cls(
            all_greedy=all(greedy),
            all_random=not any(greedy),
            greedy_mask=per_row(greedy, torch.bool),
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators={row: gen for row, (gen, g) in enumerate(zip(generators, greedy)) if gen is not None and not g},
            penalties=penalties,
            min_tokens_mask=min_tokens_mask,
            max_num_logprobs=max(requested) if requested else None,
            allowed_token_ids=allowed_token_ids,
            bad_words_mask=bad_words_mask,
            logit_bias=logit_bias,
            bad_words_per_step=bad_words_per_step,
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    # [N, 1 + max_num_logprobs] int64: sampled token first, then the top-k ids by logprob.
    logprob_token_ids: torch.Tensor | None
    logprobs: torch.Tensor | None  # [N, 1 + max_num_logprobs] float32, matching logprob_token_ids
    sampled_ranks: torch.Tensor | None = None  # [N] int64: 1 + number of tokens more likely than the sampled one
    # Both None when no row asked for logprobs. Rows asking fewer than the max use the first 1+k columns.


def _pad_token_ids(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Pad with vocab_size, an id one past the vocabulary, so padding lands in a
    scratch column of the count tensor instead of needing a mask."""
    width = max((len(r) for r in rows), default=0)
    padded = np.full((len(rows), width), vocab_size, dtype=np.int64)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    return array_to_device(padded, device)


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, L] padded ids -> [N, V] occurrence counts."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_allowed_token_ids(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Rows with allowed_token_ids: every other token to -inf, in place."""
    if batch.allowed_token_ids is not None:
        rows, banned = batch.allowed_token_ids
        logits[rows] = logits[rows].masked_fill_(banned, float("-inf"))
    return logits


def apply_bad_words(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.bad_words_mask is not None:
        rows, ids = batch.bad_words_mask
        logits[rows, ids] = float("-inf")
    return logits


def apply_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.min_tokens_mask is not None:
        rows, ids = batch.min_tokens_mask
        logits[rows, ids] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Each row's logit_bias added to its logits, in place (a banned token stays -inf)."""
    if batch.logit_bias is not None:
        rows, ids, values = batch.logit_bias
        logits.index_put_((rows, ids), values.to(logits.dtype), accumulate=True)
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """Disallowed tokens (a 0 bit; token t is bit t % 32 of int32 word t // 32) to -inf, in place.

    On a GPU a Triton kernel reads the packed words and writes only the banned logits
    (`ember.kernels.token_bitmask`); unpacking with tensor ops there took a byte per token, 39 MB of
    temporaries at 256 rows of a 152k vocabulary. On the CPU numpy unpacks the words' little-endian
    bytes in one pass (token 32 * i + 8 * k + j is bit j of byte k of word i)."""
    if bitmask is None:
        return logits
    if logits.is_cuda:
        from ember.kernels.token_bitmask import apply_token_bitmask as kernel

        return kernel(logits, bitmask)
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=logits.shape[1], bitorder="little")
    return logits.masked_fill_(torch.from_numpy(allowed) == 0, float("-inf"))


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty (prompt or output tokens), then frequency and presence (output only)."""
    pen = batch.penalties
    if pen is None:
        return logits
    vocab_size = logits.shape[1]
    output_counts = _token_counts(pen.output_token_ids, vocab_size)
    output_seen = output_counts > 0

    if pen.prompt_token_ids is not None:
        seen = output_seen | (_token_counts(pen.prompt_token_ids, vocab_size) > 0)
        rep = pen.repetition.unsqueeze(1)
        # Dividing positive and multiplying negative logits both make the token less likely.
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)

    logits = logits - pen.frequency.unsqueeze(1) * output_counts
    return logits - pen.presence.unsqueeze(1) * output_seen


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


# Candidates examined before falling back to a full-vocabulary sort: nuclei of real models are
# almost always far smaller, and torch.topk over a vocabulary is much cheaper than a sort.
TOP_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask everything outside each row's top-k and then its top-p nucleus.

    Tries the `TOP_CANDIDATES` largest logits first; only when some row's nucleus may extend past
    them does it sort the whole vocabulary. Both paths keep the same tokens.
    """
    masked = _top_k_top_p_candidates(logits, top_k, top_p)
    return masked if masked is not None else apply_top_k_top_p_sorted(logits, top_k, top_p)


def _top_k_top_p_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor | None:
    """The candidate path of `apply_top_k_top_p`; None when a full sort is needed."""
    vocab_size = logits.shape[1]
    none = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    k_on = none if top_k is None else top_k < vocab_size
    p_on = none if top_p is None else top_p < 1.0
    num = TOP_CANDIDATES if top_p is not None else 1
    if top_k is not None:
        num = max(num, int(top_k.masked_fill(~k_on, 1).max()))
    num = min(num, vocab_size)
    # One extra candidate shows whether a tie with the k-th value continues past the candidates.
    values, _ = logits.topk(min(num + 1, vocab_size), dim=-1)  # sorted, largest first
    next_value, values = values[:, num:], values[:, :num]
    keep = torch.ones_like(values, dtype=torch.bool)
    if top_k is not None:
        kth = values.gather(1, (top_k.clamp(max=num) - 1).unsqueeze(1))
        keep &= (values >= kth) | ~k_on.unsqueeze(1)
        if next_value.numel() and bool((k_on.unsqueeze(1) & (next_value == kth)).any()):
            return None
    if top_p is not None:
        kept = values.masked_fill(~keep, float("-inf"))
        # Probabilities renormalised over what top-k kept (the whole vocabulary without top-k).
        log_norm = torch.where(
            k_on.unsqueeze(1),
            torch.logsumexp(kept, dim=-1, keepdim=True),
            torch.logsumexp(logits, dim=-1, keepdim=True),
        )
        probs = (kept - log_norm).exp()
        if num < vocab_size and bool((p_on & ~k_on & (probs.sum(dim=-1) < top_p)).any()):
            return None  # some nucleus reaches past the candidates
        above = probs.cumsum(dim=-1) - probs  # mass strictly above each candidate
        keep &= (above < top_p.unsqueeze(1)) | ~p_on.unsqueeze(1)
    threshold = values.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    threshold = threshold.masked_fill(~(k_on | p_on).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """One ascending sort serves both filters.

    Tokens tied with the k-th largest logit are all kept, as in vLLM.
    """
    sorted_logits, order = logits.sort(dim=-1)
    vocab_size = logits.shape[1]
    if top_k is not None:
        kth_index = (vocab_size - top_k).clamp(min=0).unsqueeze(1)
        kth_value = sorted_logits.gather(1, kth_index)
        sorted_logits.masked_fill_(sorted_logits < kth_value, float("-inf"))
    if top_p is not None:
        # A token is dropped when everything at or below it sums to at most 1 - top_p,
        # i.e. the tokens above it already reach top_p.
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def exponential_noise(
    rows: int, vocab: int, generators: dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    """Exp(1) noise [rows, vocab], each seeded row from its own generator, floored at the smallest normal
    float so that its log stays finite. On the CPU as -log(u) of uniforms: PyTorch's `exponential_` is a
    scalar loop there, 16.3 ms against 3.6 ms for 16 rows of the default model's 49,152 tokens on 2 cores
    (2026-12-07), as much as the rest of that decode step. On a GPU `exponential_` is one pass where
    -log(u) takes three, so it stays."""
    noise = torch.empty(rows, vocab, device=device)
    draw = torch.Tensor.uniform_ if noise.is_cpu else torch.Tensor.exponential_
    if len(generators) < rows:
        draw(noise)
    for row, gen in generators.items():
        draw(noise[row], generator=gen)
    if noise.is_cpu:
        noise.log_().neg_()
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def exponential_race(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Per token, logit - log q with q ~ Exp(1): the largest picks token i with probability
    softmax(logits)_i (the exponential race argmax(p / q), in log space: no softmax pass, nothing to
    underflow), and each seeded row draws its own noise. Banning tokens afterwards (-inf) leaves the
    others' values as they are, so a grammar mask may come after this, while its fill is still running."""
    return logits - exponential_noise(logits.shape[0], logits.shape[1], generators, logits.device).log_()


def _tempered(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Random rows' transforms: temperature, then min-p, top-k and top-p."""
    if batch.temperature is not None:
        logits = logits / batch.temperature.unsqueeze(1)
    if batch.min_p is not None:
        logits = apply_min_p(logits, batch.min_p)
    if batch.top_k is not None or batch.top_p is not None:
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    return logits


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = sampled.unsqueeze(1)
    values = raw_logprobs.gather(1, ids)
    ranks = (raw_logprobs > values).sum(dim=-1) + 1
    if num_top > 0:
        top_values, top_ids = raw_logprobs.topk(num_top, dim=-1)
        ids = torch.cat([ids, top_ids], dim=1)
        values = torch.cat([values, top_values], dim=1)
    return ids, values, ranks


@dataclass
class Scores:
    """A step's sampling up to its grammar mask: per row, values whose largest allowed entry is the
    sampled token (the logits for greedy rows, the exponential race's values for random ones)."""

    values: torch.Tensor  # [N, V] float32
    raw_logprobs: torch.Tensor | None  # [N, V] float32; None when no row asked for logprobs


def _raw_logprobs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
    """vLLM reports logprobs of the model's own distribution, before any sampling transform."""
    if batch.max_num_logprobs is None:
        return None
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


def _processed(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM v1's order: allowed tokens, bad words, min_tokens, logit_bias, then the penalties, in float32
    (the head's logits widen only when something changes them)."""
    if batch.transforms_logits:
        logits = logits.float()
    logits = apply_allowed_token_ids(logits, batch)
    logits = apply_bad_words(logits, batch)
    logits = apply_min_tokens(logits, batch)
    logits = apply_logit_bias(logits, batch)
    return apply_penalties(logits, batch)


class Sampler:
    def target(self, logits: torch.Tensor, batch: SamplingBatch) -> Scores:
        """Per row the logits the sampler would draw from, without drawing: a greedy row's argmax, a random
        row's softmax is its next token's distribution (every transform and the grammar mask applied).
        What speculative decoding verifies drafts against (ember/sampling/rejection.py)."""
        logits = logits.float()
        raw_logprobs = _raw_logprobs(logits, batch)
        logits = apply_token_bitmask(_processed(logits, batch), batch.token_bitmask)
        if batch.all_greedy:
            return Scores(logits, raw_logprobs)
        tempered = _tempered(logits, batch)
        if batch.all_random:
            return Scores(tempered, raw_logprobs)
        return Scores(torch.where(batch.greedy_mask.unsqueeze(1), logits, tempered), raw_logprobs)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [N, V], the head's (`head_logits`: bf16 for a bf16 model) or float32, which may be modified
        in place. On a GPU a batch that allows it is drawn in one pass over the logits as they are, its
        grammar mask (when set) included: `SamplingBatch.one_pass`; every other path works in float32."""
        if logits.is_cuda and batch.one_pass:
            from ember.kernels.sampling import sample_race

            raw_logprobs = _raw_logprobs(logits, batch)
            logits = _processed(logits, batch)
            seed = int(torch.randint(2**31 - 1, ()))  # the engine's seed fixes these, as torch's own draws
            sampled = sample_race(logits, batch.greedy_mask, batch.temperature, seed, batch.token_bitmask)
            return _output(sampled, raw_logprobs, batch)
        return self.pick(self.score(logits, batch), batch)

    def score(self, logits: torch.Tensor, batch: SamplingBatch) -> Scores:
        """Everything before the grammar mask. When a row filters by probability (top-k, top-p, min-p),
        which must see only the allowed tokens, the mask (`batch.token_bitmask`) is applied here first;
        otherwise `pick` applies it, so this part may run while the mask is still being filled."""
        logits = logits.float()
        raw_logprobs = _raw_logprobs(logits, batch)
        logits = _processed(logits, batch)
        if not batch.mask_can_wait:
            logits = apply_token_bitmask(logits, batch.token_bitmask)
        if batch.all_greedy:
            return Scores(logits, raw_logprobs)
        random = exponential_race(_tempered(logits, batch).float(), batch.generators)
        if batch.all_random:
            return Scores(random, raw_logprobs)
        # Random scores are computed on every row and greedy rows are swapped in after,
        # which costs less than splitting the batch.
        return Scores(torch.where(batch.greedy_mask.unsqueeze(1), logits, random), raw_logprobs)

    def pick(self, scores: Scores, batch: SamplingBatch) -> SamplerOutput:
        """The sampled tokens (the grammar mask applied now when `score` left it) and their logprobs."""
        values = apply_token_bitmask(scores.values, batch.token_bitmask) if batch.mask_can_wait else scores.values
        return _output(native.rows_argmax(values), scores.raw_logprobs, batch)


def _output(sampled: torch.Tensor, raw_logprobs: torch.Tensor | None, batch: SamplingBatch) -> SamplerOutput:
    """The sampled tokens with their logprobs, when a row asked for them."""
    if raw_logprobs is None:
        return SamplerOutput(sampled, None, None)
    assert batch.max_num_logprobs is not None  # raw logprobs are computed only then
    ids, values, ranks = gather_logprobs(raw_logprobs, sampled, batch.max_num_logprobs)
    return SamplerOutput(sampled, ids, values, ranks)
