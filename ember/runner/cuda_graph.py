"""CUDA graphs of the forward pass for uniform batches, one per captured batch size: decode batches (one
token per sequence) and, with speculative decoding, verify batches (1 + k tokens per sequence: the
last known token and k drafts).

A decode step of a small model is a few hundred short kernels: launched one by one from Python,
the GPU waits on the CPU. Replaying a captured graph launches them all at once. Batches are
padded up to the next captured size; padded rows write to no cache slot (slot -1). A verify batch's
sequences are padded to 1 + k tokens each (fewer drafts: the rows after them write nowhere and are
never sampled); on the H100 an eager batch-1 verify step of the Llama-3.1-8B shape took 2.4 to 4.1
times a graphed decode step (18.8 ms for one draft), its host's kernel launches the bound.
"""

from __future__ import annotations

import logging
import time

import torch

from ember.ops.attention import AttentionMetadata
from ember.runner.input_buffers import InputBuffers

logger = logging.getLogger("ember")


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 64, 16)) + list(range(64, 512 + 1, 32))
    return sorted({min(s, max_num_seqs) for s in sizes})


def graph_metadata(buffers: InputBuffers, batch: int, query_len: int, max_seq_len: int) -> AttentionMetadata:
    """The metadata a captured graph reads: the buffers' device tensors for `batch` sequences of
    `query_len` tokens (decodes when 1, else uniform prefill-like chunks)."""
    return AttentionMetadata(
        slot_mapping=buffers.slot_mapping.dev[: batch * query_len],
        block_tables=buffers.block_tables.dev[:batch],
        seq_lens=buffers.seq_lens.dev[:batch],
        query_start_loc=buffers.query_start_loc.dev[: batch + 1],
        num_decodes=batch if query_len == 1 else 0,
        max_query_len=0 if query_len == 1 else query_len,
        max_seq_len=max_seq_len,
        seq_lens_host=[],
        query_start_host=[],
    )


class StepGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        buffers: InputBuffers,
        max_seq_len: int,
        sizes: list[int],
        query_len: int = 1,
    ) -> None:
        start = time.monotonic()
        self.sizes = sorted(sizes)
        self.query_len = query_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # per size, the target's features an EAGLE-3 head reads (CausalLM.aux_hidden_states), when kept
        self.aux_hidden_states: dict[int, torch.Tensor] = {}
        largest = self.sizes[-1]
        buffers.seq_lens.dev.fill_(query_len)
        buffers.slot_mapping.dev.fill_(-1)
        buffers.block_tables.dev.fill_(0)
        buffers.query_start_loc.dev[: largest + 1] = (
            torch.arange(largest + 1, device=buffers.query_start_loc.dev.device) * query_len
        )
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            meta = graph_metadata(buffers, bs, query_len, max_seq_len)
            ids, pos = buffers.input_ids.dev[: bs * query_len], buffers.positions.dev[: bs * query_len]
            model(ids, pos, meta)  # compiles the kernels for this shape outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = model(ids, pos, meta)
            self.graphs[bs] = graph
            aux = getattr(model, "aux_hidden_states", None)
            if aux is not None:
                self.aux_hidden_states[bs] = aux
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for %d %s batch sizes (up to %d) in %.1fs",
            len(self.sizes),
            "decode" if query_len == 1 else f"verify ({query_len} tokens a sequence)",
            self.sizes[-1],
            time.monotonic() - start,
        )

    def padded_size(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    def replay(self, padded: int) -> torch.Tensor:
        self.graphs[padded].replay()
        return self.outputs[padded]
