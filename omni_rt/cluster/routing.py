"""Least sessions first: Ray Serve's request router for the engine replicas.

A conversation is one long Serve request (`OmniReplica.claim`, open for the conversation's life), so a
replica's queue length is its sessions in use. Serve's default router compares two random replicas;
this one compares them all and takes the one with the fewest sessions among those with a free slot
(a replica at `max_ongoing_requests` is never chosen: Serve's replica refuses it anyway). Probing
every replica costs one small message per replica per new conversation, cheap next to opening one.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


class LeastSessionsRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        # One group of every candidate: Serve takes the member with the lowest known queue length that
        # still has room, probing those whose length it does not know (or knows as full).
        return [list(candidate_replicas)] if candidate_replicas else []
