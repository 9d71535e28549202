"""Ray Serve request router: requests that share a prompt prefix go to the same Ember replica.

Each replica keeps its own prefix cache, so a shared system prompt or few-shot header is computed
once per replica that sees it; spreading such requests at random makes every replica compute it.
The router ranks replicas by rendezvous (highest-random-weight) hashing of the prompt's first
characters: the top replica is tried first and, when it is full (`max_ongoing_requests` in
flight), the rest by lowest queue, which is consistent hashing with bounded load. Adding or
losing a replica moves only the prefixes that hashed to it. Requests without a prompt (models,
health, metrics) go to the least-loaded replica, and a request pinned to a replica id (the
`x-ember-replica` header) goes to that replica while it exists, so each replica's /metrics can be
read (every response names the replica that answered in the same header).
"""

from __future__ import annotations

import hashlib

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from ember.integrations.ray_serve.forwarding import ForwardedRequest


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, prefix_routing: bool = True) -> None:  # type: ignore[override]  # Ray: **kwargs
        """`prefix_routing=False` sends prompts to the least-loaded replica too (for comparison)."""
        self.prefix_routing = prefix_routing

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        request = _forwarded(pending_request)
        if request is not None and request.replica is not None:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == request.replica]
            if pinned:
                return [pinned]
        if request is None or not request.prefix or not self.prefix_routing:
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, key=lambda r: _weight(request.prefix, r.replica_id.unique_id), reverse=True)
        return [ranked[:1], ranked[1:]]


def _forwarded(pending_request: PendingRequest | None) -> ForwardedRequest | None:
    if pending_request is None:
        return None
    return next((a for a in pending_request.args if isinstance(a, ForwardedRequest)), None)


def _weight(prefix: str, replica_id: str) -> int:
    digest = hashlib.blake2b(f"{replica_id}\0{prefix}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
