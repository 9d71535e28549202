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
        vector = _embedding_step(config, req, hidden[first : first + n])
        if vector is not None:
            done.append((req.request_id, vector))
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
    width = max(v.shape[0] for _, v in done)
    out = torch.zeros(len(done), width, dtype=torch.float32, device=hidden.device)
    for i, (_, v) in enumerate(done):
        out[i, : v.shape[0]] = v
    return [(rid, v.shape[0]) for rid, v in done], out


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
