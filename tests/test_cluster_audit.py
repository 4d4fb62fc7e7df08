"""The cluster ingress under faults, without Ray: a fake of Serve's replica handle (its `claim` streams)
and fake replicas (a socket endpoint that greets and echoes), so that each failure is made on purpose,
at a known moment, in one event loop. tests/test_cluster.py runs the same paths on a real Ray cluster.
"""

from __future__ import annotations

import asyncio
import http.client
import json

import pytest

pytest.importorskip("prometheus_client")

import websockets  # noqa: E402
from websockets.asyncio.server import serve  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402

from omni_rt.cluster.ingress import OmniIngress  # noqa: E402
from omni_rt.cluster.settings import ClusterSettings  # noqa: E402

SLOTS = 2  # per fake replica
GUARD_S = 20.0  # a hang guard, not a timing claim: every wait below ends on an event long before


class FakeClaim:
    """`OmniReplica.claim` as the ingress sees it through Serve: the slot, then nothing until the
    conversation ends; it raises when its replica dies."""

    def __init__(self, replica: FakeReplica) -> None:
        self.replica = replica
        self.given_back = asyncio.Event()  # the ingress cancelled it
        self.slot_sent = False
        self.ticket = f"{replica.name}-{len(replica.claims)}"

    def __aiter__(self) -> FakeClaim:
        return self

    async def __anext__(self) -> dict:
        if not self.slot_sent:
            self.slot_sent = True
            await self.replica.accepting.wait()
            return {"replica": self.replica.name, "url": self.replica.url, "ticket": self.ticket}
        await self.replica.died.wait()
        raise RuntimeError(f"replica {self.replica.name} died")

    def cancel(self) -> None:
        self.given_back.set()


class FakeReplica:
    """A replica's session endpoint: `session.created`, then every frame echoed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.claims: list[FakeClaim] = []
        self.accepting = asyncio.Event()
        self.accepting.set()
        self.died = asyncio.Event()
        self.frames = 0
        self.heard = asyncio.Event()  # a conversation is well under way: 256 frames
        self.sockets: set = set()
        self.url = ""

    async def start(self) -> None:
        async def session(ws) -> None:
            self.sockets.add(ws)
            try:
                await ws.send(json.dumps({"type": "session.created"}))
                async for message in ws:
                    self.frames += 1
                    if self.frames == 256:
                        self.heard.set()
                    await ws.send(message)
            finally:
                self.sockets.discard(ws)

        self.server = await serve(session, "127.0.0.1", 0)
        self.url = f"ws://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/session"

    def in_use(self) -> int:
        return sum(not c.given_back.is_set() for c in self.claims)

    def die(self) -> None:
        """The process is gone: its claims raise, its sockets drop."""
        self.died.set()
        for ws in list(self.sockets):
            ws.transport.abort()

    def hang(self) -> None:
        """The process stops (SIGSTOP, a blocked event loop): nothing read, nothing answered."""
        for ws in list(self.sockets):
            ws.transport.pause_reading()


class FakeReplicas:
    """Serve's handle to the replica deployment: `claim` goes to the replica with the fewest in use."""

    def __init__(self, replicas: list[FakeReplica]) -> None:
        self.replicas = replicas

    def options(self, **_: object) -> FakeReplicas:
        return self

    @property
    def claim(self) -> FakeReplicas:
        return self

    def remote(self) -> FakeClaim:
        replica = min(self.replicas, key=FakeReplica.in_use)
        claim = FakeClaim(replica)
        replica.claims.append(claim)
        return claim


@pytest.fixture
async def front():
    """An ingress on a free port with two fake replicas reporting SLOTS free slots each."""
    replicas = [FakeReplica("a"), FakeReplica("b")]
    for replica in replicas:
        await replica.start()
    ingress = OmniIngress.__new__(OmniIngress)  # Serve awaits the async __init__ itself
    await ingress.__init__(FakeReplicas(replicas), ClusterSettings(port=0, grace_s=0))
    for replica in replicas:
        report(ingress, replica, [])
    yield ingress, replicas
    for server in [ingress._server] + [r.server for r in replicas]:
        for ws in list(server.connections):
            ws.transport.abort()
        server.close()
    # the test's ingress object: Serve, not the garbage collector, runs its (async) __del__
    ingress._server = None


def report(ingress: OmniIngress, replica: FakeReplica, tickets: list[str], ok: bool = True) -> None:
    """What `OmniReplica.load` reports: the tickets of its claims, their count, its slots."""
    load = {"replica": replica.name, "url": replica.url, "sessions": len(tickets), "max_sessions": SLOTS}
    ingress.report(load | {"tickets": tickets, "ok": ok, "metrics": ""})


async def open_conversation(ingress: OmniIngress) -> websockets.ClientConnection:
    ws = await websockets.connect(ingress.endpoint().replace("http", "ws") + "/v1/realtime")
    first = json.loads(await asyncio.wait_for(ws.recv(), GUARD_S))
    assert first["type"] == "session.created", first
    return ws


async def ending(ws: websockets.ClientConnection) -> tuple[list[dict], int | None]:
    """Every event until the socket closes (echoes left out), and the close code."""
    events = []
    with pytest.raises(ConnectionClosed):
        async with asyncio.timeout(GUARD_S):
            while True:
                event = json.loads(await ws.recv())
                if event["type"] != "echo":
                    events.append(event)
    return events, ws.close_code


async def talk(ws: websockets.ClientConnection) -> None:
    """A client that keeps sending (a microphone's audio, as fast as the socket takes it)."""
    chunk = json.dumps({"type": "echo", "audio": "A" * 4000})
    with pytest.raises(ConnectionClosed):
        while True:
            await ws.send(chunk)
            await asyncio.sleep(0)


async def lost(ws: websockets.ClientConnection, replica: FakeReplica, talking: asyncio.Task) -> None:
    """The conversation ends with `replica_lost` and close 1012, and its claim is given back."""
    events, code = await ending(ws)
    await talking
    assert [e["error"]["code"] for e in events if e["type"] == "error"] == ["replica_lost"], events
    assert code == 1012
    await asyncio.wait_for(replica.claims[0].given_back.wait(), GUARD_S)


def request(ingress: OmniIngress, method: str, path: str, body: bytes = b"", kind: str = "") -> tuple:
    host, port = ingress._server.sockets[0].getsockname()[:2]
    connection = http.client.HTTPConnection(host, port, timeout=GUARD_S)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": kind} if kind else {})
        response = connection.getresponse()
        return response.status, response.getheader("Content-Type"), response.read()
    finally:
        connection.close()


# -- a replica lost mid-conversation -------------------------------------------------------------------


@pytest.mark.parametrize("attempt", range(4))  # which relay task sees the loss first varies: a few tries
async def test_a_replica_that_dies_while_the_client_talks_ends_it_with_replica_lost(front, attempt):
    # The client talks and has not read its events yet when the replica goes, so its own frames fail
    # towards the replica first: the relay took that failed send for the client leaving and closed the
    # client with 1000 and no error.
    ingress, replicas = front
    ws = await open_conversation(ingress)
    replica = next(r for r in replicas if r.sockets)
    talking = asyncio.create_task(talk(ws))
    await asyncio.wait_for(replica.heard.wait(), GUARD_S)
    replica.die()
    await lost(ws, replica, talking)


async def test_a_replica_that_hangs_while_the_client_talks_ends_it_with_replica_lost(front):
    # The client's frames fill the socket to a replica that reads nothing: the ingress's keepalive ping
    # then waits behind them and never times out, so a full socket must count as a lost replica too.
    ingress, replicas = front
    ws = await open_conversation(ingress)
    replica = next(r for r in replicas if r.sockets)
    talking = asyncio.create_task(talk(ws))
    await ws.recv()
    replica.hang()
    await lost(ws, replica, talking)


# -- HTTP at the front door ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "kind"),
    [
        ("/v1/realtime/calls", b"v=0\r\n", "application/sdp"),
        ("/v1/realtime/client_secrets", b'{"session": {"type": "realtime"}}', "application/json"),
    ],
)
async def test_the_realtime_http_endpoints_are_answered_501_as_openai_errors(front, path, body, kind):
    # They were documented as 501; the connection was dropped with no answer (websockets refuses a
    # request with a body), which the official SDK retries as a network error.
    ingress, _ = front
    status, content_type, answer = await asyncio.to_thread(request, ingress, "POST", path, body, kind)
    assert status == 501
    assert content_type == "application/json"
    error = json.loads(answer)["error"]
    assert error["code"] == "not_implemented" and "/v1/realtime" in error["message"]


async def test_health_is_503_when_no_replica_can_serve(front):
    ingress, (a, b) = front
    status, _, body = await asyncio.to_thread(request, ingress, "GET", "/health")
    assert status == 200 and json.loads(body)["ok"]
    report(ingress, a, [], ok=False)  # one engine stopped: degraded, the other still serves
    status, _, body = await asyncio.to_thread(request, ingress, "GET", "/health")
    assert status == 200 and not json.loads(body)["ok"]
    report(ingress, b, [], ok=False)
    status, _, body = await asyncio.to_thread(request, ingress, "GET", "/health")
    assert status == 503 and not json.loads(body)["ok"]


# -- the ingress's count of sessions ---------------------------------------------------------------------


async def test_a_session_reported_before_its_claim_returns_is_counted_once(front):
    """A replica reports a new claim and returns its slot in two Serve calls: when the report came first,
    the ingress added its own +1 on top, counted the session twice and refused a client with a slot free
    (until the replica's next report)."""
    ingress, (a, b) = front
    b.claims += [FakeClaim(b), FakeClaim(b)]
    report(ingress, b, [c.ticket for c in b.claims])  # b is full
    a.accepting.clear()  # a's slot comes back after a's report of it
    first = asyncio.ensure_future(open_conversation(ingress))
    async with asyncio.timeout(GUARD_S):
        while not a.claims:
            await asyncio.sleep(0)
    report(ingress, a, [a.claims[0].ticket])
    a.accepting.set()
    one = await first
    two = await open_conversation(ingress)  # a's second slot
    assert ingress.health()["sessions"] == 2 + 2
    for ws in (one, two):
        await ws.close()
