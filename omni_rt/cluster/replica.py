"""One engine replica: a Ray Serve deployment whose every replica owns one `Engine` (one GPU, or the CPU
for `tiny`) and serves conversations to the ingress.

A conversation is a Serve request that lasts its life: the ingress calls `claim()` (a streaming call;
Serve's router picks the replica with the fewest sessions and a free slot, see `routing.py`), the replica
answers with the address of its own WebSocket endpoint on this node and a one-time ticket, and the claim
stays open until the conversation on that ticket ends. So Serve counts sessions in use as ongoing
requests: `max_ongoing_requests = max_sessions` keeps a full replica from being chosen, autoscaling on
`target_ongoing_requests` scales on sessions, and draining (Serve stops a replica only once its ongoing
requests end, or `graceful_shutdown_timeout_s` passes) lets running conversations finish.

The conversation itself runs in the same `Peer` as `omni-rt serve`'s, on a socket from the ingress, so
the wire protocol is the single-process server's, byte for byte. WebRTC offers reach the Peer over that
socket and its answer carries this node's ICE candidates: media flows between the client and this node,
never through the ingress.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from omni_rt.cluster.settings import ClusterSettings
from omni_rt.server.metrics import EngineMetrics, MeteredEngine

log = logging.getLogger("omni_rt.cluster")

CONNECT_TIMEOUT_S = 10.0  # a claim whose ticket is not used by then is given back
REPORT_INTERVAL_S = 1.0  # how often a replica tells the ingress its load (and at once on a change)
SESSION_PATH = "/session"


@dataclass
class _Claim:
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class OmniReplica:
    """The deployment's class; `app.build_app` wraps it with `serve.deployment` and its options."""

    async def __init__(self, settings: ClusterSettings, ingress_name: str) -> None:
        from ray import serve

        from omni_rt.cluster.wire import replica_host

        self.settings = settings
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self._ingress = serve.get_deployment_handle(ingress_name, context.app_name)
        self._claims: dict[str, _Claim] = {}
        self._changed = asyncio.Event()
        self.metrics = EngineMetrics()
        self.engine = MeteredEngine(await _start_engine(settings), self.metrics)
        self.host = replica_host()  # where its sessions (and their media) are reached
        self._server = await _serve_sessions(self, self.host)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.url = f"ws://{host}:{port}{SESSION_PATH}"
        self._reporter = asyncio.create_task(self._report_forever())
        log.info(
            "replica %s: %s, %d sessions at %s",
            self.replica_id,
            settings.model,
            settings.max_sessions,
            self.url,
        )

    # -- Serve calls ------------------------------------------------------------------------------------

    async def claim(self):
        """Reserve a session slot: yields {replica, url, ticket}, then lasts until that conversation ends
        (or its ticket goes unused for CONNECT_TIMEOUT_S, or the ingress cancels the call)."""
        ticket = secrets.token_urlsafe(24)
        claim = self._claims[ticket] = _Claim()
        self._changed.set()
        try:
            yield {"replica": self.replica_id, "url": self.url, "ticket": ticket}
            try:
                await asyncio.wait_for(claim.connected.wait(), CONNECT_TIMEOUT_S)
            except TimeoutError:
                log.warning("replica %s: a claimed slot was never connected; given back", self.replica_id)
                return
            await claim.ended.wait()
        finally:
            del self._claims[ticket]
            self._changed.set()

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine stopped, or whose device stopped making progress
        (`Engine.stall`: only a new process recovers it), is restarted."""
        if not self.engine.running:
            raise RuntimeError(f"replica {self.replica_id}: the engine is not running")
        if (stall := getattr(self.engine, "stall", None)) is not None:
            raise RuntimeError(f"replica {self.replica_id}: {stall}")

    async def __del__(self) -> None:
        """Serve stops the replica (after draining): close what is left, then the engine."""
        if getattr(self, "_reporter", None) is None:  # stopped before __init__ finished
            return
        self._reporter.cancel()
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 5.0)
        await self.engine.stop()

    # -- the session endpoint ---------------------------------------------------------------------------

    def _check_ticket(self, connection: Any, request: Any) -> Any:
        from omni_rt.cluster.wire import http_response

        url = urlsplit(request.path)
        if url.path == "/health":
            body = json.dumps(self.load()).encode()
            return http_response(HTTPStatus.OK, body, "application/json")
        if url.path == "/metrics":
            body, kind = self.metrics.exposition()
            return http_response(HTTPStatus.OK, body, kind)
        if url.path != SESSION_PATH:
            return http_response(HTTPStatus.NOT_FOUND, b"Not found.\n", "text/plain")
        ticket = parse_qs(url.query).get("ticket", [""])[0]
        claim = self._claims.get(ticket)
        if claim is None or claim.connected.is_set():
            return connection.respond(HTTPStatus.UNAUTHORIZED, "Unknown or used ticket.\n")
        claim.connected.set()
        return None

    async def _handle(self, ws: Any) -> None:
        from omni_rt.server.peer import Peer

        ticket = parse_qs(urlsplit(ws.request.path).query).get("ticket", [""])[0]
        claim = self._claims.get(ticket)
        if claim is None:  # the claim was given back between the check and the upgrade
            await ws.close(1013, "claim expired")
            return
        try:
            await Peer(self.engine, ws, _peer_settings(self.settings, self.host)).run()
        finally:
            claim.ended.set()

    # -- load reports -----------------------------------------------------------------------------------

    def load(self) -> dict[str, Any]:
        return {
            "replica": self.replica_id,
            "url": self.url,
            "sessions": len(self._claims),
            # which claims: the ingress counts each session once, whether this report or the claim's slot
            # reaches it first (two Serve calls)
            "tickets": sorted(self._claims),
            "max_sessions": self.settings.max_sessions,
            "ok": self.engine.running,
        }

    async def _report_forever(self) -> None:
        """Tell the ingress this replica's load and metrics: every REPORT_INTERVAL_S, and at once when a
        session starts or ends (the ingress says `session_limit` from these without asking Serve)."""
        while True:
            self._changed.clear()
            report = self.load() | {"metrics": self.metrics.exposition()[0].decode(), "at": time.time()}
            try:
                await self._ingress.report.remote(report)
            except Exception as exc:  # the ingress restarting: the next report reaches the new one
                log.warning("replica %s: report to the ingress failed: %s", self.replica_id, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), REPORT_INTERVAL_S)


async def _start_engine(settings: ClusterSettings) -> Any:
    import torch

    import omni_rt

    # CPU replicas share a node's cores: one intra-op thread each unless told otherwise.
    torch.set_num_threads(settings.torch_threads)
    kwargs: dict[str, Any] = dict(settings.extra)
    if settings.device:
        kwargs["device"] = settings.device
    if settings.dtype:
        kwargs["dtype"] = settings.dtype
    engine = await asyncio.to_thread(
        omni_rt.Engine.load, settings.model, max_sessions=settings.max_sessions, **kwargs
    )
    await engine.start()
    return engine


def _peer_settings(settings: ClusterSettings, host: str) -> Any:
    from omni_rt.server.app import is_loopback
    from omni_rt.server.peer import PeerSettings
    from omni_rt.server.webrtc import IcePolicy

    return PeerSettings(
        model=Path(settings.model).name,
        voice=settings.voice,
        ice_servers=tuple(settings.ice_servers),
        # a node known by a loopback address (a one-machine cluster) offers media on loopback alone, as
        # omni-rt serve on loopback does; any other node offers every interface and the STUN/TURN servers
        ice_policy=IcePolicy.for_bind(host) if is_loopback(host) else None,
        idle=settings.idle,  # type: ignore[arg-type]
        max_audio_frames=settings.audio_frames,
    )


async def _serve_sessions(replica: OmniReplica, host: str) -> Any:
    from websockets.asyncio.server import serve

    from omni_rt.server import protocol

    return await serve(
        replica._handle,
        host,
        0,
        process_request=replica._check_ticket,
        max_size=4 * protocol.MAX_MESSAGE_BYTES,  # as omni-rt serve: the peer answers over-size itself
        max_queue=16,
        ping_interval=20,
        ping_timeout=20,
        close_timeout=2,
    )
