"""Pooling: a pooling request's final hidden states (after the model's final norm) become one vector.

A pooling request runs its prompt through prefill like any other, chunked by the scheduler's token
budget, and is never sampled. Each step it is in, `pool_step` folds its rows into the request's
state: MEAN keeps a float32 running sum across chunks, CLS the first position's row, LAST needs only
the prompt's last row. In the step that computes the prompt's last token the vector is finished:
cut to `dimensions` (Matryoshka), then L2-normalized unless the request or the engine says not.

A score request (`task` "score") takes one row whatever the engine's pooling type, and its vector is one
float: a decoder reranker's (`score_token_ids`, ember/pooling/score.py) is P(true token) at the prompt's
last position, the softmax over the two tokens' logits from the LM head's two rows only
(`CausalLM.token_logits`); a cross-encoder's is the sigmoid of its classifier's one logit on the first
token (`EncoderModel.classify`, as sentence-transformers' CrossEncoder scores), its whole prompt in the step.

A chunk that starts at position 0 starts the state afresh: a preempted request recomputes from there
(MEAN and CLS take no prefix-cache hits, `PoolerConfig.needs_every_token`, so they always do).
"""

from __future__ import annotations

import torch

from ember.model.bert import EncoderModel
from ember.model.llama import CausalLM
from ember.model.registry import Model
from ember.pooling.params import PoolerConfig
from ember.runner.request_state import RequestState


def pool_step(
    config: PoolerConfig, spans: list[tuple[RequestState, int, int]], hidden: torch.Tensor, model: Model
) -> tuple[list[tuple[str, int]], torch.Tensor | None]:
    """Fold this step's rows into its pooling requests. Returns (id, length) of each request whose prompt
    ended, and their vectors as one [N, width] float32 tensor on the device (zero-padded to the longest
    where `dimensions` differ; one copy to the host for the step), or None when none ended."""
    done: list[tuple[str, torch.Tensor]] = []
    scored: list[tuple[str, int, list[int]]] = []  # decoder rerankers: (id, its last row, [true id, false id])
    classified: list[tuple[str, int]] = []  # cross-encoders: (id, its first row)
    whole: list[tuple[RequestState, int, int]] = []  # embeddings of prompts computed whole in this step
    for req, first, n in spans:
        params = req.pooling_params
        if params is None:
            continue
        if params.task == "score":
            if req.num_computed_tokens + n < req.num_prompt_tokens:
                continue
            if params.score_token_ids is None:
                classified.append((req.request_id, first))
            else:
                scored.append((req.request_id, first + n - 1, params.score_token_ids))
            continue
        if req.num_computed_tokens == 0 and n == req.num_prompt_tokens and req.pooled is None:
            whole.append((req, first, n))  # the whole prompt in this step: pooled with the others at once
            continue
        vector = _embedding_step(config, req, hidden[first : first + n])
        if vector is not None:
            done.append((req.request_id, vector))
    for group in _by_dimensions(whole):
        vectors = _whole_prompts(config, group, hidden)
        done += [(req.request_id, vectors[i]) for i, (req, _, _) in enumerate(group)]
    if scored:
        assert isinstance(model, CausalLM), "EngineCore admits score_token_ids for decoders only"
        rows = hidden[torch.tensor([row for _, row, _ in scored], device=hidden.device)]
        ids = torch.tensor([tokens for _, _, tokens in scored], device=hidden.device)
        probs = torch.softmax(model.token_logits(rows, ids), dim=-1)[:, :1]  # P(true) of each
        done += [(rid, probs[i]) for i, (rid, _, _) in enumerate(scored)]
    if classified:
        assert isinstance(model, EncoderModel), "EngineCore admits classifier scores for cross-encoders only"
        rows = hidden[torch.tensor([row for _, row in classified], device=hidden.device)]
        probs = torch.sigmoid(model.classify(rows)[:, :1])
        done += [(rid, probs[i]) for i, (rid, _) in enumerate(classified)]
    if not done:
        return [], None
    widths = [v.shape[0] for _, v in done]
    if min(widths) == max(widths):  # one launch for the step's vectors
        return [(rid, v.shape[0]) for rid, v in done], torch.stack([v for _, v in done])
    out = torch.zeros(len(done), max(widths), dtype=torch.float32, device=hidden.device)
    for i, (_, v) in enumerate(done):
        out[i, : v.shape[0]] = v
    return [(rid, v.shape[0]) for rid, v in done], out


def _by_dimensions(spans: list[tuple[RequestState, int, int]]) -> list[list[tuple[RequestState, int, int]]]:
    """The spans grouped by their Matryoshka cut (requests of one cut pool as one batch)."""
    groups: dict[int | None, list[tuple[RequestState, int, int]]] = {}
    for span in spans:
        params = span[0].pooling_params
        assert params is not None  # only pooling requests are grouped
        groups.setdefault(params.dimensions, []).append(span)
    return list(groups.values())


def _whole_prompts(
    config: PoolerConfig, spans: list[tuple[RequestState, int, int]], hidden: torch.Tensor
) -> torch.Tensor:
    """The vectors [B, width] of requests whose whole prompts ran in this step (an encoder's always do), in a
    few launches for the batch. Pooled one request at a time, a step of 256 whole prompts ran 3,746 aten ops
    (about 7 kernels a request: sum, divide, norm, clamp, divide, copy), 697 this way (torch.profiler, a
    one-layer BERT on the CPU): on the H100, BERT-base embedding throughput is bounded by the host."""
    device = hidden.device
    firsts = torch.tensor([first for _, first, _ in spans], device=device)
    lengths = torch.tensor([n for _, _, n in spans], device=device)
    total = sum(n for _, _, n in spans)
    if config.pooling_type == "MEAN":
        seg = torch.repeat_interleave(torch.arange(len(spans), device=device), lengths, output_size=total)
        starts = (firsts - torch.cumsum(lengths, 0) + lengths)[seg]  # each row's request's first row, less its offset
        rows = starts + torch.arange(total, device=device)
        sums = torch.zeros(len(spans), hidden.shape[1], dtype=torch.float32, device=device)
        vectors = sums.index_add_(0, seg, hidden.index_select(0, rows).float()) / lengths[:, None]
    else:  # CLS: the first row; LAST: the last
        vectors = hidden.index_select(0, firsts if config.pooling_type == "CLS" else firsts + lengths - 1).float()
    params = [req.pooling_params for req, _, _ in spans if req.pooling_params is not None]
    assert len(params) == len(spans)  # only pooling requests come here
    dimensions = params[0].dimensions  # one cut per group (_by_dimensions)
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    normalize = [config.normalize if p.normalize is None else p.normalize for p in params]
    if not any(normalize):
        return vectors
    normalized = torch.nn.functional.normalize(vectors, dim=-1)
    if all(normalize):
        return normalized
    return torch.where(torch.tensor(normalize, device=device)[:, None], normalized, vectors)


def _embedding_step(config: PoolerConfig, req: RequestState, rows: torch.Tensor) -> torch.Tensor | None:
    """Fold one request's rows of the step into its state; its finished vector once its prompt ended."""
    params = req.pooling_params
    assert params is not None  # asked only of pooling requests
    start, n = req.num_computed_tokens, rows.shape[0]
    if config.pooling_type == "MEAN":
        total = rows.sum(0, dtype=torch.float32)
        req.pooled = total if start == 0 or req.pooled is None else req.pooled + total
    elif config.pooling_type == "CLS" and start == 0:
        req.pooled = rows[0].float()
    if start + n < req.num_prompt_tokens:
        return None
    if config.pooling_type == "LAST":
        vector = rows[-1].float()
    else:
        assert req.pooled is not None  # set by the chunk at position 0 (MEAN and CLS take no cache hits)
        vector = req.pooled / req.num_prompt_tokens if config.pooling_type == "MEAN" else req.pooled
    req.pooled = None
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    normalize = config.normalize if params.normalize is None else params.normalize
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector
