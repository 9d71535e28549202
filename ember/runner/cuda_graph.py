"""CUDA graphs of the forward pass for decode-only batches, one per captured batch size.

A decode step of a small model is a few hundred short kernels: launched one by one from Python,
the GPU waits on the CPU. Replaying a captured graph launches them all at once. Batches are
padded up to the next captured size; padded rows write to no cache slot (slot -1).
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


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, buffers: InputBuffers, max_seq_len: int, sizes: list[int]) -> None:
        start = time.monotonic()
        self.sizes = sorted(sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # per size, the target's features an EAGLE-3 head reads (CausalLM.aux_hidden_states), when kept
        self.aux_hidden_states: dict[int, torch.Tensor] = {}
        buffers.seq_lens.dev.fill_(1)
        buffers.slot_mapping.dev.fill_(-1)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            meta = decode_metadata(buffers, bs, max_seq_len)
            ids, pos = buffers.input_ids.dev[:bs], buffers.positions.dev[:bs]
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
            "captured CUDA graphs for %d decode batch sizes (up to %d) in %.1fs",
            len(self.sizes),
            self.sizes[-1],
            time.monotonic() - start,
        )

    def padded_size(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    def replay(self, padded: int) -> torch.Tensor:
        self.graphs[padded].replay()
        return self.outputs[padded]
