"""CUDA graphs of the forward pass: decode-only batches by their row count, and a lone prefill chunk by
its token count.

A decode step of a small model is a few hundred short kernels: launched one by one from Python,
the GPU waits on the CPU. Replaying a captured graph launches them all at once. Batches are
padded up to the next captured size; padded rows write to no cache slot (slot -1).

A prefill chunk is the same few hundred kernels, each launched through Triton's Python launcher: on
the H100, 25-30 ms of host time for a 512-token prompt of the Qwen3-0.6B or Llama-3.1-8B shape,
while the GPU needed about 1 and 14 ms of it (the time to first token was the host's). A request
alone in its step (a batch-1 prompt, or a long prompt's chunks) replays a graph captured at the next
token count in `PREFILL_SIZES` instead: one sequence, its pad tokens in none (query_start_loc ends at
the real ones), so attention skips them and writes zeros there (`AttentionMetadata.pad_rows`), and
every other op is row by row. Batches of several prompts, or of prompts and decodes, run eagerly.

With LoRA on, every size is captured twice on the one memory pool (the second set's intermediates reuse
it, so it adds mostly its outputs, but it doubles the capture time): with the LoRA kernels in, which read
each token's adapter slot on the device and so replay any mix of adapters, and without them, for steps of
the base alone (`graph_key`: a step with a token under an adapter never replays that set, which would drop
its deltas). Replaying the LoRA kernels in every step cost the base model alone 0.647x of its throughput
on an engine without LoRA (H100, Llama-3.1-8B shape, the nano-vllm workload); vLLM captures such a
second set too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch

from ember.ops.attention import AttentionMetadata
from ember.runner.input_buffers import InputBuffers
from ember.runner.step_inputs import GraphKey, GraphSizes

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger("ember")
# Prefill chunk lengths captured, as vLLM's piecewise graphs stop at 512 tokens: a longer chunk's GPU time
# outweighs its launches (14 ms for 512 tokens of the 8B shape).
PREFILL_SIZES = (32, 64, 128, 256, 384, 512)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 64, 16)) + list(range(64, 512 + 1, 32))
    return sorted({min(s, max_num_seqs) for s in sizes})


def prefill_capture_sizes(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    return [s for s in PREFILL_SIZES if s <= min(max_num_batched_tokens, max_model_len)]


def decode_metadata(buffers: InputBuffers, batch: int, max_seq_len: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=buffers.slot_mapping.dev[:batch],
        block_tables=buffers.block_tables.dev[:batch],
        seq_lens=buffers.seq_lens.dev[:batch],
        query_start_loc=buffers.query_start_loc.dev[: batch + 1],
        num_decodes=batch,
        max_query_len=0,
        max_seq_len=max_seq_len,
        seq_lens_host=[],
        query_start_host=[],
    )


def prefill_metadata(buffers: InputBuffers, tokens: int, max_seq_len: int) -> AttentionMetadata:
    """One sequence of up to `tokens` new tokens (the grid is sized for all of them)."""
    return AttentionMetadata(
        slot_mapping=buffers.slot_mapping.dev[:tokens],
        block_tables=buffers.block_tables.dev[:1],
        seq_lens=buffers.seq_lens.dev[:1],
        query_start_loc=buffers.query_start_loc.dev[:2],
        num_decodes=0,
        max_query_len=tokens,
        max_seq_len=max_seq_len,
        seq_lens_host=[tokens],
        query_start_host=[0, tokens],
        pad_rows=True,
    )


class StepGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        buffers: InputBuffers,
        max_seq_len: int,
        decode_sizes: list[int],
        prefill_sizes: list[int],
        lora: Callable[[bool], AbstractContextManager[None]] | None = None,
    ) -> None:
        """`lora`: with LoRA on, the context in which a capture holds the LoRA deltas (True) or none
        (`LoRAManager.capturing`); each size is then captured both ways."""
        start = time.monotonic()
        self.sizes = GraphSizes(tuple(sorted(decode_sizes)), tuple(sorted(prefill_sizes)))
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        # per graph, the target's features an EAGLE-3 head reads (CausalLM.aux_hidden_states), when kept
        self.aux_hidden_states: dict[GraphKey, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        modes = (True, False) if lora is not None else (False,)
        sizes = [(n, False) for n in decode_sizes] + [(n, True) for n in prefill_sizes]
        keys = [GraphKey(n, prefill, on) for n, prefill in sizes for on in modes]
        for key in sorted(keys, reverse=True):  # most tokens first, so smaller graphs reuse its memory pool
            with nullcontext() if lora is None else lora(key.lora):
                self._capture(model, buffers, max_seq_len, key, pool)
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for %d decode batch sizes (up to %d) and %d prefill lengths (up to %d)%s in %.1fs",
            len(decode_sizes),
            max(decode_sizes, default=0),
            len(prefill_sizes),
            max(prefill_sizes, default=0),
            ", each with the LoRA kernels and without" if lora is not None else "",
            time.monotonic() - start,
        )

    def _capture(
        self, model: torch.nn.Module, buffers: InputBuffers, max_seq_len: int, key: GraphKey, pool: _POOL_HANDLE
    ) -> None:
        n, prefill = key.size, key.prefill
        buffers.slot_mapping.dev.fill_(-1)
        if prefill:  # one sequence of n tokens, so that the kernels read a valid context while capturing
            buffers.seq_lens.dev[:1].fill_(n)
            buffers.query_start_loc.dev[:2].copy_(torch.tensor([0, n], dtype=torch.int32))
            meta = prefill_metadata(buffers, n, max_seq_len)
        else:
            buffers.seq_lens.dev.fill_(1)
            meta = decode_metadata(buffers, n, max_seq_len)
        ids, pos = buffers.input_ids.dev[:n], buffers.rope_positions(n)
        model(ids, pos, meta)  # compiles the kernels for this shape outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[key] = model(ids, pos, meta)
        self.graphs[key] = graph
        aux = getattr(model, "aux_hidden_states", None)
        if aux is not None:
            self.aux_hidden_states[key] = aux

    def replay(self, key: GraphKey) -> torch.Tensor:
        self.graphs[key].replay()
        return self.outputs[key]
