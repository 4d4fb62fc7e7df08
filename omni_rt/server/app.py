"""`omni-rt serve`: the demo page, the realtime WebSocket (`/v1/realtime`, `/ws`) and OpenAI's Realtime
HTTP endpoints (`rest.py`) on one port.

HTTP GET requests for the page are answered from the handshake hook of `websockets` (no second web
framework); `/ws` upgrades to a WebSocket and gets its own `Peer` and `Session`. Checks happen before
the upgrade: the Origin (same origin unless allowed), then the token. Everything past the upgrade that
goes wrong is an `error` event to that client, never a crash of the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import logging
import mimetypes
import signal
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers, MultipleValuesError
from websockets.http11 import Request, Response

from omni_rt import collector
from omni_rt.config import EngineSettings, setting_overrides
from omni_rt.model.config import PRESETS, preset
from omni_rt.server import protocol
from omni_rt.server.http import BodyConnection
from omni_rt.server.peer import Peer, PeerSettings
from omni_rt.server.protocol import ProtocolError
from omni_rt.server.rest import HttpAnswer, RealtimeHttp, refused
from omni_rt.server.transport import CLOSE_TIMEOUT_S
from omni_rt.server.webrtc import IcePolicy, ice_server

log = logging.getLogger("omni_rt.server")


# The tiny preset's random weights babble until a limit: a demo reply of a few seconds is enough to hear.
TINY_REPLY_SECONDS = 8.0


def find_web_dir() -> Path | None:
    """The demo page: packaged as `omni_rt/web` when installed, `<repo>/web` in a checkout."""
    package = Path(__file__).resolve().parent.parent  # omni_rt/
    for candidate in (package / "web", package.parent / "web"):
        if (candidate / "index.html").is_file():
            return candidate.resolve()
    return None


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port (tests)
    token: str | None = None  # required on /ws when set: ?token=T or "Authorization: Bearer T"
    max_sessions: int = 4
    allowed_origins: Sequence[str] = ()  # besides the server's own origin; "*" allows any
    web_dir: Path | None = None  # None: find_web_dir()
    peer: PeerSettings = field(default_factory=PeerSettings)


class Server:
    """Serves one started `Engine` to browsers and realtime clients. Use as `async with Server(...)`."""

    def __init__(self, engine: Any, settings: ServerSettings | None = None, sock: Any = None) -> None:
        """`sock`: a listening socket bound before (`omni-rt serve` binds before the model loads);
        None: bind `settings.host` and `settings.port` at start."""
        self.engine = engine
        self.settings = settings or ServerSettings()
        self._sock = sock
        web_dir = self.settings.web_dir or find_web_dir()
        self.web_dir = web_dir.resolve() if web_dir is not None else None
        if self.web_dir is None:
            # /ws works without it; only the demo page is missing (an install without package data).
            log.warning("the demo page (web/) was not found: serving /ws only")
        peer = self.settings.peer
        if peer.ice_policy is None:  # media follows the bind address (issue #13, defect 7)
            policy = IcePolicy.for_bind(self.settings.host, peer.ice_servers, peer.ice_public_address)
            self.settings = dataclasses.replace(
                self.settings, peer=dataclasses.replace(peer, ice_policy=policy)
            )
        if peer.start_lead_ms is None:  # the lead the engine's chunk plan counts on
            lead = getattr(getattr(engine, "settings", None), "playout_lead_ms", None) or 0
            self.settings = dataclasses.replace(
                self.settings, peer=dataclasses.replace(self.settings.peer, start_lead_ms=lead)
            )
        self._allowed_origins = {normalize_origin(o) for o in self.settings.allowed_origins}
        self._loopback = is_loopback(self.settings.host)
        self.peers: set[Peer] = set()  # WebSocket connections and calls
        self.rest = RealtimeHttp(self)
        self._server: Any = None
        self._handlers: set[asyncio.Task] = set()
        self._held = False  # holds omni_rt.collector's freeze (from start to close)

    async def start(self) -> None:
        s = self.settings
        where = {"sock": self._sock} if self._sock is not None else {"host": s.host, "port": s.port}
        self._server = await serve(
            self._handle,
            **where,
            process_request=self._process_request,
            server_header="omni-rt",  # no versions for a probe to match against
            create_connection=BodyConnection,  # POST bodies for /v1/realtime/calls, client_secrets
            # Our own limit answers with an error event; this one is the backstop for absurd frames.
            # Frames buffered here, at most 4 (16 MiB), then the inbox's 8 MiB (transport.py).
            max_size=2 * s.peer.max_message_bytes,
            max_queue=4,
            ping_interval=20,
            ping_timeout=20,
            # Don't let a client that never closes its end hold a shutdown (or a slot) for long.
            close_timeout=2,
        )
        # What is alive now (the web stack's objects too) outlives the server: frozen out of the cycle
        # collector's full scans while it runs (omni_rt.collector says why)
        collector.hold()
        self._held = True

    async def close(self) -> None:
        if self._server is None:
            return
        if self._held:
            collector.release()
            self._held = False
        self._server.close()  # stops accepting, closes every socket: each peer then cleans up
        try:
            await asyncio.wait_for(self._server.wait_closed(), CLOSE_TIMEOUT_S)
        except TimeoutError:
            # websockets' close handshake first waits, without a limit, for the socket to drain: a
            # client that stopped reading would hold the shutdown until its ping times out. Cut it.
            for connection in list(self._server.all_connections):
                connection.transport.abort()
            await self._server.wait_closed()
        await asyncio.gather(*(p.close() for p in list(self.peers)), return_exceptions=True)
        self._server = None

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def has_room(self) -> bool:
        return len(self.peers) < self.settings.max_sessions

    def run_peer(self, peer: Peer, on_end: Any) -> None:
        """Serve a call's peer (one without a socket) in the background until it ends."""

        async def serve() -> None:
            try:
                await peer.run()
            finally:
                self.peers.discard(peer)
                on_end()
                log.info("%s closed after %d responses", peer.session_id, peer.responses)

        task = asyncio.create_task(serve(), name=f"{peer.session_id} call")
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    def session_preview(self, fields: protocol.SessionFields | None) -> dict[str, Any]:
        """The session object that a session opened with this configuration starts with;
        `ProtocolError` for one that a session would refuse (checked as `Peer.configure` applies it)."""
        peer = Peer(self.engine, None, self.settings.peer)
        if fields is not None:
            peer.configure(fields)
        return peer.session_object()

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        """Where a browser on this machine opens the page (with the token, when there is one)."""
        host = self.settings.host
        if host in ("", "0.0.0.0", "::"):
            host = "127.0.0.1"  # all interfaces: loopback is one of them
        host = f"[{host}]" if ":" in host else host
        url = f"http://{host}:{self.port}/"
        return f"{url}?token={quote(self.settings.token, safe='')}" if self.settings.token else url

    # -- HTTP, before any upgrade ---------------------------------------------------------------------

    async def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        # only the REST endpoints take a body; every other path is GET or HEAD
        if request.method not in ("GET", "HEAD") and not self.rest.handles(urlsplit(request.path).path):
            return _response(HTTPStatus.METHOD_NOT_ALLOWED, b"Only GET and HEAD.\n", "text/plain")
        response = await self._route(connection, request)
        if request.method == "HEAD" and response is not None:  # the headers of a GET, no body
            response = dataclasses.replace(response, body=b"")
        return response

    async def _route(self, connection: ServerConnection, request: Request) -> Response | None:
        url = urlsplit(request.path)
        rest = self.rest.handles(url.path)
        try:
            origin = request.headers.get("Origin")
            host = request.headers.get("Host", "")
            bearer = _bearer(request.headers.get("Authorization", ""))
        except MultipleValuesError:  # which one would count? Neither.
            repeated = "repeated Origin, Host or Authorization"
            if rest:
                return _rest_response(refused(HTTPStatus.BAD_REQUEST, "invalid_request", repeated), None)
            return connection.respond(HTTPStatus.BAD_REQUEST, f"{repeated.capitalize()}.\n")
        if rest:
            # Every answer of an OpenAI endpoint is OpenAI's JSON error when it refuses: the SDK reads
            # its code (plain text was an APIStatusError without one).
            if origin is not None and not self._origin_allowed(origin, host):
                log.warning("refused %s from origin %s (Host %s)", url.path, origin, host)
                forbidden = refused(HTTPStatus.FORBIDDEN, "origin_not_allowed", "this Origin is not allowed")
                return _rest_response(forbidden, None)
            if request.method == "OPTIONS" and origin is not None:
                return _preflight(request.headers)
            problem = getattr(connection, "body_error", None)
            if problem is not None:
                return _rest_response(refused(*problem), origin)
            answer = await self.rest.handle(
                request.method, url.path, request.headers, getattr(connection, "body", None), bearer
            )
            return _rest_response(answer, origin)
        if is_realtime_path(url.path):
            return self._check_ws(connection, url.query, origin, host, bearer)
        if url.path == "/health":
            health: dict[str, Any] = {
                "ok": True, "sessions": len(self.peers), "max_sessions": self.settings.max_sessions,
            }  # fmt: skip
            if (capacity := getattr(self.engine, "capacity", None)) is not None:  # the engine's own ceiling
                health["engine"] = capacity.as_dict()
            if (stall := getattr(self.engine, "stall", None)) is not None:  # the device stopped: restart
                health.update(ok=False, error={"code": stall.code, "message": str(stall)})
            body = json.dumps(health)
            status = HTTPStatus.OK if health["ok"] else HTTPStatus.SERVICE_UNAVAILABLE
            return _response(status, body.encode(), "application/json")
        if url.path == "/metrics" and hasattr(self.engine, "metrics"):  # a MeteredEngine (server/metrics.py)
            return _response(HTTPStatus.OK, *self.engine.metrics.exposition())
        return self._static(url.path)

    def _check_ws(
        self, connection: ServerConnection, query: str, origin: str | None, host: str, bearer: str | None
    ) -> Response | None:
        if origin is not None and not self._origin_allowed(origin, host):
            log.warning("refused /ws from origin %s (Host %s)", origin, host)
            return connection.respond(HTTPStatus.FORBIDDEN, "Origin not allowed.\n")
        asked = parse_qs(query)
        given = bearer if bearer is not None else asked.get("token", [""])[0]
        allowed, secret = self.rest.authorize(given, keys=True)
        if not allowed:
            return connection.respond(HTTPStatus.UNAUTHORIZED, "A valid token is required.\n")
        # What the SDK's connect() can also ask for and a socket here cannot be: rather a clear refusal
        # than a fresh realtime session that the client takes for the call or the transcriber it wanted.
        if "call_id" in asked:
            return connection.respond(
                HTTPStatus.BAD_REQUEST, "Joining a call (call_id) is not supported: use its data channel.\n"
            )
        if "transcription" in asked.get("intent", []):
            return connection.respond(HTTPStatus.BAD_REQUEST, "Transcription sessions are not served.\n")
        # The key's session configuration, for the peer that this connection becomes.
        connection.client_secret = secret  # type: ignore[attr-defined]
        return None  # websockets answers a plain GET here with 426 Upgrade Required

    def _origin_allowed(self, origin: str, host: str) -> bool:
        return origin_allowed(origin, host, self._allowed_origins, self._loopback)

    def _static(self, path: str) -> Response:
        if self.web_dir is None:
            return _response(HTTPStatus.NOT_FOUND, b"The demo page is not installed; /ws is.\n", "text/plain")
        name = "index.html" if path in ("/", "/index.html") else path.lstrip("/")
        not_found = _response(HTTPStatus.NOT_FOUND, b"Not found.\n", "text/plain")
        try:
            file = (self.web_dir / name).resolve()
            # Only plain files directly inside web/: no traversal, no hidden files, no directories.
            if file.parent != self.web_dir or name.startswith(".") or not file.is_file():
                return not_found
        except (ValueError, OSError):  # a NUL byte, a name too long for the file system: no such file
            return not_found
        kind = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
        if kind.startswith("text/") or kind in ("application/javascript", "text/javascript"):
            kind += "; charset=utf-8"
        return _response(HTTPStatus.OK, file.read_bytes(), kind)

    # -- WebSocket ------------------------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        if not self.has_room():
            busy = ProtocolError(
                "session_limit",
                f"the server is at its limit of {self.settings.max_sessions} sessions; try again later",
                type="server_error",
            )
            await ws.send(json.dumps(protocol.error(busy)))
            await ws.close(1013, "session limit")
            return
        secret = getattr(ws, "client_secret", None)
        peer = Peer(
            self.engine,
            ws,
            self.settings.peer,
            sessions=[secret.session] if secret and secret.session else [],
        )
        self.peers.add(peer)
        log.info(
            "%s opened from %s (%d/%d)",
            peer.session_id,
            _remote(ws),
            len(self.peers),
            self.settings.max_sessions,
        )
        try:
            await peer.run()
        finally:
            self.peers.discard(peer)
            log.info("%s closed after %d responses", peer.session_id, peer.responses)


def is_realtime_path(path: str) -> bool:
    """The WebSocket endpoint: `/ws`, or where OpenAI's clients look for it, any path ending in
    `/realtime` (the official SDK opens `<base>/realtime?model=M`; `/v1/realtime` for most)."""
    return path == "/ws" or path.rstrip("/").endswith("/realtime")


def _bearer(authorization: str) -> str | None:
    """The credentials of an `Authorization: Bearer ...` header (schemes are case-insensitive, RFC 9110)."""
    scheme, _, credentials = authorization.partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else None


def normalize_origin(origin: str) -> str:
    """`scheme://host[:port]` as browsers write an Origin: lower-case, no path, no default port."""
    if origin == "*":
        return origin
    parts = urlsplit(origin.strip())
    scheme, name, port = parts.scheme.lower(), parts.hostname, parts.port  # .port: ValueError if bad
    if scheme not in ("http", "https") or not name:
        raise ValueError(f"not an http(s) origin: {origin!r}")
    name = f"[{name}]" if ":" in name else name
    default = {"http": 80, "https": 443}[scheme]
    return f"{scheme}://{name}" if port in (None, default) else f"{scheme}://{name}:{port}"


def origin_allowed(origin: str, host: str, allowed: Sequence[str], loopback: bool) -> bool:
    """May a page from `origin` use a server reached as `host`? Allowed origins ("*": any), or the same
    origin: a page this server served, under the same host:port. On a loopback server, same origin only
    under a loopback name: any other name that reaches it is DNS rebinding (a site whose name now points
    at 127.0.0.1), whose page would otherwise pass as "same origin"."""
    try:
        origin = normalize_origin(origin)
        own = normalize_origin(f"{urlsplit(origin).scheme}://{host}")
    except ValueError:  # "null" (a sandboxed or file: page), garbage
        return False
    if "*" in allowed or origin in allowed:
        return True
    return origin == own and (not loopback or is_loopback(urlsplit(origin).hostname or ""))


def is_loopback(name: str) -> bool:
    """localhost, 127.x.x.x or ::1 (a name as a URL or a listening address writes it)."""
    name = name.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _remote(ws: ServerConnection) -> str:
    address = ws.remote_address
    return f"{address[0]}:{address[1]}" if address else "?"


def _rest_response(answer: HttpAnswer, origin: str | None) -> Response:
    """A REST endpoint's answer; `origin`: an allowed page's, which may read it (CORS)."""
    response = _response(answer.status, answer.body, answer.content_type)
    for name, value in answer.headers.items():
        if name in response.headers:  # the endpoint's own (its Allow: POST), not the default
            del response.headers[name]
        response.headers[name] = value
    if origin is not None:
        _allow_origin(response, origin)
        response.headers["Access-Control-Expose-Headers"] = "Location"
    return response


def _allow_origin(response: Response, origin: str) -> None:
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Vary"] = "Origin"


def _preflight(headers: Headers) -> Response:
    """The answer to a browser's CORS preflight for a REST endpoint, from an origin already allowed:
    OpenAI's browser flow POSTs the offer (Bearer key, application/sdp) to the realtime server, which is
    another origin than the page's. The headers the page asked for are allowed: the origin is trusted."""
    response = _response(HTTPStatus.NO_CONTENT, b"", "text/plain")
    _allow_origin(response, headers["Origin"])
    response.headers["Access-Control-Allow-Methods"] = "POST"
    asked = headers.get("Access-Control-Request-Headers")
    response.headers["Access-Control-Allow-Headers"] = asked or "Authorization, Content-Type"
    response.headers["Access-Control-Max-Age"] = "600"
    return response


def _response(status: HTTPStatus, body: bytes, content_type: str) -> Response:
    headers = Headers()
    headers["Content-Type"] = content_type
    headers["Content-Length"] = str(len(body))
    headers["Cache-Control"] = "no-cache"
    headers["Connection"] = "close"  # one request per connection: this is a WebSocket server at heart
    headers["X-Content-Type-Options"] = "nosniff"
    headers["Referrer-Policy"] = "no-referrer"  # the page's URL may carry the token
    if status == HTTPStatus.METHOD_NOT_ALLOWED:
        headers["Allow"] = "GET, HEAD"
    return Response(status.value, status.phrase, headers, body)


# -- the command ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="omni-rt serve",
        description="Serve the demo page and realtime sessions over WebRTC and WebSocket.",
    )
    p.add_argument("--model", default="tiny", help="preset name or checkpoint directory (default: tiny)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the engine's choice)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: the engine's choice)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port for the page and /ws (default: 8080)")
    p.add_argument("--token", default=None, help="require this token on /ws (?token=T or a Bearer header)")
    p.add_argument("--max-sessions", type=int, default=4, help="concurrent sessions (default: 4)")
    p.add_argument("--voice", default="ethan", help="default voice of new sessions")
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="another page origin allowed on /ws",
    )
    p.add_argument(
        "--ice-server",
        action="append",
        default=[],
        metavar="URL",
        help="STUN/TURN URL, used when listening on all interfaces (default: none; LAN only)",
    )
    p.add_argument(
        "--ice-public-address",
        default=None,
        metavar="IP",
        help="behind a 1:1 NAT: the public address to announce in ICE candidates instead of the bound one",
    )
    p.add_argument(
        "--max-audio-seconds",
        type=float,
        default=None,
        help="longest spoken reply (default: 60; 8 for the tiny preset, whose random weights never stop by "
        "themselves)",
    )
    p.add_argument(
        "--idle",
        choices=("nothing", "silence"),
        default="silence",
        help="what the audio track sends between replies (default: silence; nothing makes Chromium's "
        "jitter buffer grow when replies come less than ~3 s apart)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine setting (omni_rt.EngineSettings; VALUE as JSON), e.g. --set stall_timeout_s=20; "
        "repeat for more",
    )
    args = p.parse_args(argv)
    if args.max_sessions < 1:
        p.error("--max-sessions must be at least 1")
    try:  # the values checked now, not after minutes of loading a checkpoint
        args.engine_settings = setting_overrides(args.set)
        if "max_sessions" in args.engine_settings:
            p.error("--set max_sessions: use --max-sessions (the server admits as many as the engine)")
        EngineSettings(max_sessions=args.max_sessions, **args.engine_settings)
    except ValueError as exc:  # a pydantic ValidationError is one
        p.error(str(exc))
    for origin in args.allow_origin:
        try:
            normalize_origin(origin)
        except ValueError as exc:
            p.error(f"--allow-origin: {exc}")
    for url in args.ice_server:
        try:
            ice_server(url)
        except ValueError as exc:
            p.error(str(exc))
    if args.ice_public_address is not None:
        try:
            IcePolicy(public_address=args.ice_public_address)
        except ValueError:
            p.error(f"--ice-public-address must be an IP address, not {args.ice_public_address!r}")
    if args.max_audio_seconds is None:
        args.max_audio_seconds = TINY_REPLY_SECONDS if args.model == "tiny" else 60.0
    if args.max_audio_seconds <= 0:
        p.error("--max-audio-seconds must be positive")
    if not 0 <= args.port < 65536:
        p.error("--port must be 0..65535")
    return args


async def serve_forever(args: argparse.Namespace) -> None:
    import omni_rt

    load_kwargs: dict[str, Any] = {}
    if args.device:
        load_kwargs["device"] = args.device
    if args.dtype:
        load_kwargs["dtype"] = args.dtype
    if args.model in PRESETS:  # a voice the preset lacks: say so now, not as a refused connection later
        _check_voice(preset(args.model), args.voice)
    # Bind before the model loads (minutes on a real checkpoint): a port in use fails now. Connections
    # that come meanwhile wait in the listen backlog.
    sock = socket.create_server(
        (args.host, args.port), family=socket.AF_INET6 if ":" in args.host else socket.AF_INET
    )
    print(f"omni-rt: loading {args.model} ...", flush=True)
    try:
        # One engine slot per session the server admits.
        engine = omni_rt.Engine.load(
            args.model, max_sessions=args.max_sessions, **load_kwargs, **args.engine_settings
        )
        _check_voice(engine.cfg, args.voice)
    except BaseException:
        sock.close()
        raise
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        token=args.token,
        max_sessions=args.max_sessions,
        allowed_origins=tuple(args.allow_origin),
        peer=PeerSettings(
            model=Path(args.model).name,
            voice=args.voice,
            ice_servers=tuple(args.ice_server),
            ice_public_address=args.ice_public_address,
            idle=args.idle,
            max_audio_frames=max(1, round(args.max_audio_seconds / 0.08)),
        ),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # not on Windows
            loop.add_signal_handler(sig, stop.set)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.token:
        print(
            "omni-rt: warning: listening beyond this machine without --token: anyone who can reach it can talk"
        )
    from omni_rt.server.metrics import EngineMetrics, MeteredEngine

    async with engine, Server(MeteredEngine(engine, EngineMetrics()), settings, sock=sock) as server:
        print(f"omni-rt: serving {args.model} at {server.url}  (Ctrl-C to stop)", flush=True)
        await stop.wait()
    print("omni-rt: stopped", flush=True)


def _check_voice(cfg: Any, voice: str) -> None:
    from omni_rt.errors import ConfigError

    try:
        cfg.speaker_id(voice)
    except KeyError as e:
        raise ConfigError(f"--voice {voice}: {e.args[0]}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Per-request lines from the libraries drown ours: one line per session is enough.
    logging.getLogger("websockets").setLevel(logging.WARNING)
    logging.getLogger("aioice").setLevel(logging.WARNING)
    logging.getLogger("aiortc").setLevel(logging.WARNING)
    from omni_rt.errors import OmniRtError

    try:
        asyncio.run(serve_forever(args))
    except (OSError, OmniRtError) as exc:  # the port is taken, an unknown model, a bad checkpoint
        print(f"omni-rt serve: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C while stopping
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
