"""Which steps replay a CUDA graph, and how a step is padded to one (host side: runs anywhere).

The GPU side (the graphs' outputs equal the eager forward's) is tests/test_hf_equality.py and
tests/test_batching.py under EMBER_TEST_DEVICE=cuda, where every lone prompt of up to 512 tokens
replays a prefill graph, and tests/test_lora.py's graphs with and without the LoRA kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.lora.request import LoRARequest
from ember.runner.input_buffers import InputBuffers
from ember.runner.request_state import RequestState
from ember.runner.step_broadcast import StepHeader
from ember.runner.step_inputs import GraphKey, GraphSizes, graph_key, prepare_step
from ember.sampling.params import SamplingParams

BLOCK = 4
SIZES = GraphSizes(decode=(1, 2, 4, 8), prefill=(8, 16, 32))


def _request(name: str, prompt_len: int, computed: int = 0, lora: LoRARequest | None = None) -> RequestState:
    r = RequestState(name, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=4), [0], lora_request=lora)
    r.block_ids = list(range(10 * len(name), 10 * len(name) + -(-(prompt_len + 4) // BLOCK)))
    r.num_computed_tokens = computed
    return r


def _prepare(requests: list[RequestState], new_tokens: list[int]) -> tuple[StepHeader, InputBuffers]:
    buffers = InputBuffers(64, 8, 16, torch.device("cpu"))
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):  # stale values from an earlier step
        getattr(buffers, name).np[:] = 99
    return prepare_step(requests, new_tokens, buffers, BLOCK, SIZES).header, buffers


@pytest.mark.parametrize(("prompt_len", "computed", "padded"), [(5, 0, 8), (13, 0, 16), (20, 4, 16), (32, 0, 32)])
def test_a_lone_prefill_chunk_pads_to_a_prefill_graph(prompt_len, computed, padded):
    chunk = prompt_len - computed
    h, b = _prepare([_request("a", prompt_len, computed)], [chunk])
    assert (h.padded, h.prefill_graph, h.rows, h.tokens) == (padded, True, 1, padded)
    assert b.query_start_loc.np[:2].tolist() == [0, chunk]  # the pad tokens are in no sequence
    assert b.seq_lens.np[0] == prompt_len
    assert (b.slot_mapping.np[chunk:padded] == -1).all() and (b.slot_mapping.np[:chunk] >= 0).all()
    assert (b.input_ids.np[chunk:padded] == 0).all() and (b.positions.np[chunk:padded] == 0).all()
    np.testing.assert_array_equal(b.positions.np[:chunk], np.arange(computed, prompt_len))


def test_steps_without_a_graph_run_eagerly():
    long, _ = _prepare([_request("a", 40)], [40])  # past the largest prefill graph
    two, _ = _prepare([_request("a", 5), _request("bb", 6)], [5, 6])  # two prompts
    a = _request("a", 5, computed=5)
    a.token_ids.append(7)
    mixed, _ = _prepare([a, _request("bb", 6)], [1, 6])  # a decode beside a prompt
    assert [h.padded for h in (long, two, mixed)] == [0, 0, 0]
    assert not any(h.prefill_graph for h in (long, two, mixed))


def test_decode_batches_pad_rows_not_tokens():
    reqs = []
    for name in ("a", "bb", "ccc"):
        r = _request(name, 5, computed=5)
        r.token_ids.append(7)
        reqs.append(r)
    h, b = _prepare(reqs, [1, 1, 1])
    assert (h.padded, h.prefill_graph, h.rows, h.tokens) == (4, False, 4, 4)
    assert b.seq_lens.np[3] == 1 and b.slot_mapping.np[3] == -1  # the pad row attends to one token, writes none


def _decodes(loras: list[LoRARequest | None]) -> list[RequestState]:
    reqs = [_request("d" * (i + 1), 5, computed=5, lora=lora) for i, lora in enumerate(loras)]
    for r in reqs:
        r.token_ids.append(7)
    return reqs


def test_a_step_with_an_adapter_replays_only_graphs_with_the_lora_kernels():
    """With LoRA on, each graph size is captured with the LoRA kernels and without: a step of the base alone
    takes the one without, and a step with any token under an adapter (one decode among the base's, a lone
    prompt chunk) the one with, so an adapter's deltas are never dropped. Checked against the slots the
    step writes, which the LoRA kernels read."""
    lora = LoRARequest("a", 7, "/a")
    buffers = InputBuffers(64, 8, 16, torch.device("cpu"), lora=True)
    assert buffers.lora_slots is not None

    def key(requests: list[RequestState], new_tokens: list[int]) -> GraphKey | None:
        header = prepare_step(requests, new_tokens, buffers, BLOCK, SIZES, {7: 2}).header
        adapted = bool((buffers.lora_slots.np[: header.num_tokens] >= 0).any())
        assert header.lora == adapted
        return graph_key(header)

    assert key(_decodes([None, None, None]), [1, 1, 1]) == GraphKey(4, False, False)
    assert key(_decodes([None, lora, None]), [1, 1, 1]) == GraphKey(4, False, True)
    assert key(_decodes([lora]), [1]) == GraphKey(1, False, True)
    assert key([_request("p", 5)], [5]) == GraphKey(8, True, False)
    assert key([_request("p", 5, lora=lora)], [5]) == GraphKey(8, True, True)
    assert key([*_decodes([None]), _request("p", 5, lora=lora)], [1, 5]) is None  # eager: `active` decides
    plain, _ = _prepare(_decodes([None, None]), [1, 1])  # an engine without LoRA
    assert graph_key(plain) == GraphKey(2, False, False)
