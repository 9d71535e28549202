"""The paged KV cache's block pool: allocation, reference counts and prefix caching.

Every full block gets a hash chained with its parent's, so a hash identifies the whole prefix up
to and including that block; the first block's parent is the request's LoRA adapter, if any, so two
adapters never share KV. Blocks whose requests have finished keep their hash and sit in the
free queue as LRU candidates: a later request with the same prefix takes them back instead of
recomputing, until an allocation evicts them. Token ids are compared on every hit, so a hash
collision can never serve the wrong KV.

When every layer of the model attends through the same sliding window, a running request's blocks
that lie wholly left of its next query's window are never read again and are released early
(`drop_out_of_window`). They stay in the request's block list, as placeholders that keep positions
and that the kernels never read (they start at the window's edge), but no longer count as its own:
a released block that holds a cached prefix keeps its hash and can still serve a later hit, since
its contents stay exactly those tokens' KV until an allocation takes it; one that was not cached yet
is never cached afterwards, because it may already hold another request's KV by then. Stream order
makes the early release safe under async scheduling: a step still running that reads such a block
finishes before any later step can write into it.

The manager owns each request's block table and prefix hashes (`block_table`) and never writes into
`Request`: it reads the request's tokens and computed count, and answers the scheduler with what changed
(`Allocation`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ember.core.request import Request
from ember.multimodal.inputs import images_in


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int | str, ...] | None = None  # see BlockManager._block_tokens


@dataclass(frozen=True)
class Allocation:
    """What a successful `allocate` added to the end of the request's block table (prefix hits first):
    the scheduler passes them on to the model runner, which keeps its own copy of the table."""

    block_ids: list[int]


@dataclass
class _RequestBlocks:
    """The manager's record of one request, from its first prefix lookup or allocation until `free`."""

    block_ids: list[int] = field(default_factory=list)  # the block table: position p is in block p // block_size
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks, computed lazily
    num_hashed: int = 0  # leading blocks found in or registered with the prefix cache
    num_dropped: int = 0  # leading blocks released by drop_out_of_window (placeholders in the table)


def hash_block(parent_hash: int | None, token_ids: tuple[int | str, ...]) -> int:
    return hash((parent_hash, token_ids))


def _root_hash(request: Request) -> int | None:
    """The first block's parent: none for the base model, the adapter's id under a LoRA adapter, whose KV
    differs from the base's for the same tokens (so every later block's hash differs too)."""
    return None if request.lora_request is None else hash(("lora", request.lora_request.lora_int_id))


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, sliding_window: int | None = None
    ) -> None:
        """`sliding_window`: the window every layer attends through, or None (some or all layers
        see the whole context) to keep each request's blocks until it ends."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Front = next to hand out. Uncached blocks go to the front, cached ones to the back (LRU).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_blocks: dict[int, int] = {}
        self._requests: dict[str, _RequestBlocks] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_table(self, request_id: str) -> Sequence[int]:
        """The request's block table, in position order; empty before its first allocation and after `free`.
        The manager's own list, not a copy (the scheduler reads it every step): valid until the next call
        that changes the request's blocks."""
        record = self._requests.get(request_id)
        return record.block_ids if record is not None else []

    def _record(self, request: Request) -> _RequestBlocks:
        """The request's record, made on first use."""
        record = self._requests.get(request.request_id)
        if record is None:
            record = self._requests[request.request_id] = _RequestBlocks()
        return record

    def _block_tokens(self, request: Request, index: int) -> tuple[int | str, ...]:
        """What identifies a block's content: its tokens, and the content hash and first position of each
        image whose tokens it holds (image tokens are one id whatever the image: without the key, two
        prompts with different pictures would share KV)."""
        start = index * self.block_size
        tokens: tuple[int | str, ...] = tuple(request.all_token_ids[start : start + self.block_size])
        for image in images_in(request.images, start, start + self.block_size):
            tokens += (image.key, image.offset - start)
        return tokens

    def _hashes(self, record: _RequestBlocks, request: Request, num_full_blocks: int) -> list[int]:
        """The request's block hashes, computed up to at least `num_full_blocks`."""
        hashes = record.block_hashes
        while len(hashes) < num_full_blocks:
            parent = hashes[-1] if hashes else _root_hash(request)
            hashes.append(hash_block(parent, self._block_tokens(request, len(hashes))))
        return hashes

    def match_prefix(self, request: Request) -> list[int]:
        """Cached blocks holding a prefix of the request's tokens; at least one token is left to compute.

        A request that wants prompt logprobs gets none: cached positions would have no logits; nor does a
        pooling request that pools every position (MEAN) or the first (CLS): they would not be computed.
        """
        if (
            not self.enable_prefix_caching
            or request.sampling_params.prompt_logprobs is not None
            or request.skip_prefix_cache
        ):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes(self._record(request), request, max_blocks)
        hits = []
        for i in range(max_blocks):
            block_id = self.cached_blocks.get(hashes[i])
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(request, i):
                break
            hits.append(block_id)
        return hits

    def allocate(
        self, request: Request, num_new_tokens: int, prefix_blocks: list[int] | None = None
    ) -> Allocation | None:
        """Give the request enough blocks for `num_new_tokens` more tokens, or change nothing and return None.

        `prefix_blocks` (from `match_prefix`, maybe empty) is passed exactly when a request that holds
        no blocks is scheduled, which is also when a prefix-cache query is counted.
        """
        is_query = prefix_blocks is not None
        prefix_blocks = prefix_blocks or []
        num_computed = request.num_computed_tokens + len(prefix_blocks) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = needed - len(self.block_table(request.request_id)) - len(prefix_blocks)
        num_revived = sum(1 for b in prefix_blocks if self.blocks[b].ref_cnt == 0)
        if num_new_blocks + num_revived > self.num_free_blocks:
            return None
        for block_id in prefix_blocks:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1
        added = list(prefix_blocks)
        for _ in range(num_new_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self.cached_blocks[block.block_hash]
                block.block_hash = block.token_ids = None
            block.ref_cnt = 1
            added.append(block_id)
        record = self._record(request)
        record.block_ids.extend(added)
        if is_query and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(prefix_blocks) * self.block_size
            record.num_hashed = len(prefix_blocks)
        return Allocation(added)

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that the request's first `num_tokens` tokens (computed, and known on the
        host) fill, so later requests can share them."""
        record = self._requests.get(request.request_id)
        if not self.enable_prefix_caching or record is None:  # None: preempted since the step was scheduled
            return
        start = max(record.num_hashed, record.num_dropped)
        num_full = num_tokens // self.block_size
        if num_full <= start:
            return
        hashes = self._hashes(record, request, num_full)
        for i in range(start, num_full):
            block = self.blocks[record.block_ids[i]]
            h = hashes[i]
            if block.block_hash is None and h not in self.cached_blocks:
                block.block_hash = h
                block.token_ids = self._block_tokens(request, i)
                self.cached_blocks[h] = block.block_id
        record.num_hashed = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use, as in vLLM."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = block.token_ids = None
        self.cached_blocks.clear()
        return True

    def drop_out_of_window(self, request: Request) -> None:
        """Release the request's blocks that no query from its next one on can see: the next query
        sits at num_computed_tokens and sees only positions above num_computed_tokens - sliding_window."""
        record = self._requests.get(request.request_id)
        if self.sliding_window is None or record is None:
            return
        dead = max(0, request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        dead = min(dead, len(record.block_ids))
        if dead <= record.num_dropped:
            return
        for block_id in record.block_ids[record.num_dropped : dead]:
            self._release(block_id)
        record.num_dropped = dead

    def trim(self, request: Request, num_tokens: int) -> int | None:
        """Release the request's tail blocks past its first `num_tokens` tokens (slots of rejected draft
        tokens): the number of blocks it keeps, or None when nothing was released. Tail blocks hold no
        full block of known tokens, so none is in the prefix cache."""
        record = self._requests.get(request.request_id)
        if record is None:
            return None
        keep = max(-(-num_tokens // self.block_size), record.num_dropped)
        if keep >= len(record.block_ids):
            return None
        for block_id in reversed(record.block_ids[keep:]):
            self._release(block_id)
        del record.block_ids[keep:]
        return keep

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail blocks first so a shared prefix outlives its suffixes, and
        forget its table and hashes: a preempted request computes its hashes again when it comes back, a
        small cost beside recomputing its KV."""
        record = self._requests.pop(request.request_id, None)
        if record is None:
            return
        for block_id in reversed(record.block_ids[record.num_dropped :]):
            self._release(block_id)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue[block_id] = None
            if block.block_hash is None:
                self.free_queue.move_to_end(block_id, last=False)
