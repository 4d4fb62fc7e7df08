"""The cluster's one public endpoint: each new realtime connection goes to an engine replica with a free
session slot (the fewest sessions first) and stays there for its life.

The ingress is a Ray Serve deployment that listens on its own port with the same `websockets` server
as `omni-rt serve` (Serve's HTTP proxy is ASGI; a conversation is one long socket, not requests). Per
connection it checks the Origin and the token, claims a slot (`OmniReplica.claim`: Serve's router picks
the replica), opens a socket to that replica's session endpoint and relays frames both ways, untouched.
WebRTC offers and answers are frames like any other, so the answer carries the replica node's ICE
candidates and media goes straight to that node.

When no replica has room (from the load every replica reports, at once on each change) the client gets
the documented `session_limit` error and close 1013 without waiting. When a replica dies, its sockets
drop (the process is gone) or stop answering pings (the node is gone): each of its conversations gets
an `error` event (`replica_lost`) and close 1012, and the next conversations go to the living replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge
from websockets.protocol import State

from omni_rt.cluster.settings import ClusterSettings
from omni_rt.cluster.wire import header, http_response, merged_metrics, query_value
from omni_rt.server import protocol
from omni_rt.server.app import is_loopback, normalize_origin, origin_allowed
from omni_rt.server.http import BodyConnection
from omni_rt.server.protocol import ProtocolError
from omni_rt.server.rest import RealtimeHttp, refused

log = logging.getLogger("omni_rt.cluster")

REALTIME_PATHS = ("/ws", "/v1/realtime")  # the single-process server's socket, under both names
CLAIM_TIMEOUT_S = 3.0  # Serve found no slot this long although the reports said there was one
STALE_S = 3.0  # a replica silent this long is taken for gone
# Ingress -> replica: pings find a replica whose node vanished (no FIN, no RST) within ~3 s.
UPSTREAM_PING_S = 1.0
UPSTREAM_PING_TIMEOUT_S = 2.0
CLOSE_TIMEOUT_S = 2.0
# A replica whose socket takes no frame this long is hung: its peer reads its socket into an inbox at
# once. The pings above cannot tell, as a ping waits behind the frames that fill the socket.
REPLICA_TAKES_S = UPSTREAM_PING_S + UPSTREAM_PING_TIMEOUT_S
LOST_CLOSE_CODE = 1012  # "service restart": the client may open a new conversation at once


class OmniIngress:
    """The deployment's class; `app.build_app` wraps it with `serve.deployment` and its options."""

    async def __init__(self, replicas: Any, settings: ClusterSettings) -> None:
        from websockets.asyncio.server import serve

        self.settings = settings
        self._replicas = replicas.options(stream=True)
        self._reports: dict[str, dict[str, Any]] = {}
        # tickets of the conversations relayed now, by replica: counted with the tickets each replica
        # reports, as one set, so a session is one whether the report or the claim's slot came first
        self._relaying: dict[str, set[str]] = {}
        self._allowed = {normalize_origin(o) for o in settings.allowed_origins}
        self.registry = CollectorRegistry(auto_describe=True)
        self._live_gauge = Gauge("omni_rt_cluster_replicas", "Replicas reporting", registry=self.registry)
        self._rejected = Counter(
            "omni_rt_cluster_session_limit",
            "Connections refused: no replica had room",
            registry=self.registry,
        )
        self._lost = Counter(
            "omni_rt_cluster_replica_lost",
            "Conversations ended by their replica's loss",
            registry=self.registry,
        )
        self._server = await serve(
            self._relay,
            settings.host,
            settings.port,
            process_request=self._http,
            # POSTs with a body (/v1/realtime/calls, client_secrets) reach _http: websockets drops them
            create_connection=BodyConnection,
            max_size=4 * protocol.MAX_MESSAGE_BYTES,  # the replica's peer answers over-size frames itself
            max_queue=16,
            ping_interval=20,
            ping_timeout=20,
            close_timeout=CLOSE_TIMEOUT_S,
            # A redeploy starts the new ingress while the old one drains: both hold the port a while.
            reuse_port=True,
        )
        log.info("ingress at %s", self.endpoint())

    # -- Serve calls ------------------------------------------------------------------------------------

    def report(self, report: dict[str, Any]) -> None:
        """A replica's load and metrics (`OmniReplica._report_forever`)."""
        self._reports[report["replica"]] = report | {"seen": time.monotonic()}

    def endpoint(self) -> str:
        host, port = self._server.sockets[0].getsockname()[:2]
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        return f"http://{host}:{port}"

    def health(self) -> dict[str, Any]:
        live = self._live()
        return {
            "ok": bool(live) and all(r["ok"] for r in live),
            "replicas": len(live),
            "sessions": sum(r["sessions"] for r in live),
            "max_sessions": sum(r["max_sessions"] for r in live),
            "per_replica": [{k: r[k] for k in ("replica", "sessions", "max_sessions", "ok")} for r in live],
        }

    async def __del__(self) -> None:
        """Draining (a redeploy): take no new connections (the new ingress, on the same port, takes
        them) and relay the open ones until they end or `grace_s` passes; then close those left."""
        if getattr(self, "_server", None) is None:  # stopped before __init__ finished
            return
        self._server.close(close_connections=False)
        try:
            await asyncio.wait_for(self._server.wait_closed(), self.settings.grace_s)
        except TimeoutError:
            await asyncio.gather(*(_close(c, 1001, "server restart") for c in list(self._server.connections)))

    def _live(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        for replica in [r for r, rep in self._reports.items() if now - rep["seen"] > STALE_S]:
            del self._reports[replica]
        self._live_gauge.set(len(self._reports))
        return [rep | {"sessions": self._sessions(rep)} for rep in self._reports.values()]

    def _sessions(self, rep: dict[str, Any]) -> int:
        """A replica's sessions: the claims it reported with those relayed since (a report without its
        tickets, as its count)."""
        tickets = set(rep.get("tickets", ())) | self._relaying.get(rep["replica"], set())
        return max(rep["sessions"], len(tickets))

    # -- HTTP, before any upgrade ---------------------------------------------------------------------

    def _http(self, connection: Any, request: Any) -> Any:
        url = urlsplit(request.path)
        if url.path == "/health":
            health = self.health()
            # 503 when no replica can serve (none reporting, or every engine stopped): a load balancer or
            # a probe then sees a front door that serves nobody; `ok` is false as soon as any one fails.
            serving = any(r["ok"] for r in health["per_replica"])
            status = HTTPStatus.OK if serving else HTTPStatus.SERVICE_UNAVAILABLE
            return http_response(status, json.dumps(health).encode(), "application/json")
        if url.path == "/metrics":
            texts = {r["replica"]: r["metrics"] for r in self._live()}
            return http_response(
                HTTPStatus.OK, merged_metrics(texts, self.registry), "text/plain; version=0.0.4"
            )
        if RealtimeHttp.handles(url.path):  # the single-process server's REST endpoints (server/rest.py)
            message = "not served through the cluster ingress yet: use the realtime WebSocket (/v1/realtime)"
            answer = refused(HTTPStatus.NOT_IMPLEMENTED, "not_implemented", message)  # OpenAI's JSON error
            return http_response(answer.status, answer.body, answer.content_type)
        if url.path not in REALTIME_PATHS:
            return http_response(HTTPStatus.NOT_FOUND, b"Not found.\n", "text/plain")
        try:
            origin, host, auth = (header(request, h) for h in ("Origin", "Host", "Authorization"))
        except ValueError as exc:
            return connection.respond(HTTPStatus.BAD_REQUEST, f"{str(exc).capitalize()}.\n")
        if origin is not None and not self._origin_allowed(origin, host or ""):
            return connection.respond(HTTPStatus.FORBIDDEN, "Origin not allowed.\n")
        if self.settings.token is not None:
            given = query_value(url.query, "token")
            scheme, _, credentials = (auth or "").partition(" ")
            if scheme.lower() == "bearer":
                given = credentials.strip()
            if not hmac.compare_digest(given.encode(), self.settings.token.encode()):
                return connection.respond(HTTPStatus.UNAUTHORIZED, "A valid token is required.\n")
        return None

    def _origin_allowed(self, origin: str, host: str) -> bool:
        # the single-process server's rule, one function for both
        return origin_allowed(origin, host, self._allowed, is_loopback(self.settings.host))

    # -- one conversation -----------------------------------------------------------------------------

    async def _relay(self, client: Any) -> None:
        if not any(r["sessions"] < r["max_sessions"] for r in self._live()):
            await self._refuse(client)
            return
        claim = self._replicas.claim.remote()
        try:
            slot = await asyncio.wait_for(claim.__anext__(), CLAIM_TIMEOUT_S)
        except TimeoutError:  # every replica filled up since it last reported
            claim.cancel()
            await self._refuse(client)
            return
        except Exception as exc:  # Serve refused (back pressure) or the chosen replica died
            claim.cancel()
            log.warning("ingress: no slot: %s", exc)
            await self._refuse(client)
            return
        relaying = self._relaying.setdefault(slot["replica"], set())
        relaying.add(slot["ticket"])  # counted before that replica's next report says so itself
        try:
            await self._pipe(client, slot, claim)
        finally:
            claim.cancel()
            relaying.discard(slot["ticket"])

    async def _pipe(self, client: Any, slot: dict[str, Any], claim: Any) -> None:
        from websockets.asyncio.client import connect

        try:
            upstream = await connect(
                f"{slot['url']}?ticket={slot['ticket']}",
                max_size=None,  # the replica's frames are the protocol's; the client's limit applies
                max_queue=16,
                ping_interval=UPSTREAM_PING_S,
                ping_timeout=UPSTREAM_PING_TIMEOUT_S,
                close_timeout=CLOSE_TIMEOUT_S,
                open_timeout=5,
                compression=None,  # loopback or a cluster network: deflate costs latency, saves nothing
            )
        except Exception as exc:
            log.warning("ingress: replica %s unreachable: %s", slot["replica"], exc)
            await self._lose(client)
            return
        up = asyncio.create_task(_forward(upstream, client), name="replica->client")
        down = asyncio.create_task(_forward(client, upstream, REPLICA_TAKES_S), name="client->replica")
        watch = asyncio.create_task(_drain(claim), name="claim")
        try:
            await asyncio.wait((up, down, watch), return_when=asyncio.FIRST_COMPLETED)
            if watch.done() and watch.exception() is not None:
                log.warning("ingress: replica %s lost: %s", slot["replica"], watch.exception())
            elif watch.done():
                # The conversation ended on the replica: its socket's close is on the way.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(up), CLOSE_TIMEOUT_S)
            if down.done() and isinstance(down.exception(), TimeoutError):
                log.warning("ingress: replica %s stopped reading: lost", slot["replica"])
        finally:
            for task in (up, down, watch):
                task.cancel()
            await asyncio.gather(up, down, watch, return_exceptions=True)
        try:
            # Who ended it is read from the two sockets, not from which relay task ended first: a relay
            # task also ends when its send to the *other* side fails (a client that talks while its
            # replica dies fails towards the replica first).
            if client.state is not State.OPEN:  # the client left (or broke the protocol): end its session
                await _close(upstream, 1000, "")
            elif (closed := upstream.protocol.close_rcvd) is not None:  # the replica closed: pass it on
                await _close(client, closed.code, closed.reason)
            else:  # no close frame from the replica: it is gone, or hung
                await self._lose(client)
        finally:
            await _close(upstream, 1000, "")

    async def _refuse(self, client: Any) -> None:
        self._rejected.inc()
        capacity = sum(r["max_sessions"] for r in self._live())
        busy = ProtocolError(
            "session_limit",
            f"every replica is at its session limit ({capacity} sessions in all); try again later",
            type="server_error",
        )
        await _goodbye(client, busy, 1013, "session limit")

    async def _lose(self, client: Any) -> None:
        self._lost.inc()
        lost = ProtocolError(
            "replica_lost",
            "the server running this conversation stopped; open a new conversation",
            type="server_error",
        )
        await _goodbye(client, lost, LOST_CLOSE_CODE, "replica lost")


async def _goodbye(client: Any, error: ProtocolError, code: int, reason: str) -> None:
    """The error event, then the close; bounded, as a client that stopped reading never takes either."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.send(json.dumps(protocol.error(error))), CLOSE_TIMEOUT_S)
    await _close(client, code, reason)


async def _forward(source: Any, sink: Any, timeout: float | None = None) -> None:
    """Every frame from `source` to `sink`, as it came (text stays text, bytes stay bytes); TimeoutError
    when `sink` takes no frame for `timeout` seconds."""
    from websockets.exceptions import ConnectionClosed

    with contextlib.suppress(ConnectionClosed):
        async for message in source:
            await asyncio.wait_for(sink.send(message), timeout)


async def _drain(claim: Any) -> None:
    """The claim's stream yields nothing after the slot; it ends with the conversation, or raises when
    its replica dies."""
    async for _ in claim:
        pass


async def _close(ws: Any, code: int, reason: str) -> None:
    try:
        await asyncio.wait_for(ws.close(code, reason), CLOSE_TIMEOUT_S)
    except TimeoutError:
        ws.transport.abort()
    except Exception:  # already gone
        ws.transport.abort()
