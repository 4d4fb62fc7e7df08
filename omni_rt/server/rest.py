"""OpenAI's Realtime HTTP endpoints: ephemeral client secrets and WebRTC calls.

- `POST /v1/realtime/client_secrets` (server token required when the server has one): an ephemeral
  key `ek_…` with its `expires_at`, and optionally a session configuration that every session opened
  with the key starts from. A browser uses the key as its Bearer, so the server's own token never
  reaches a page. Keys live in memory until they expire.
- `POST /v1/realtime/calls` (server token or a live key): a raw `application/sdp` offer, or
  `multipart/form-data` with `sdp` and `session` (JSON). Answered `201 Created` with the SDP answer and
  `Location: /v1/realtime/calls/{call_id}`. The call's events travel on its `oai-events` data channel;
  it lives until `POST /v1/realtime/calls/{call_id}/hangup`, or until its WebRTC connection or channel
  ends.

Paths are matched by their ending (`…/realtime/calls`), as `app.is_realtime_path` matches the WebSocket.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_rt.errors import OmniRtError
from omni_rt.server import protocol
from omni_rt.server.http import multipart_fields
from omni_rt.server.peer import Peer
from omni_rt.server.protocol import ProtocolError

if TYPE_CHECKING:
    from omni_rt.server.app import Server

log = logging.getLogger("omni_rt.server")

DEFAULT_TTL_S = 600  # OpenAI's default for a client secret
MAX_TTL_S = 7200
MAX_KEYS = 1024  # live keys; past this the oldest give way (a token holder minting in a loop)


class _ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"] = "created_at"
    seconds: int = Field(default=DEFAULT_TTL_S, ge=10, le=MAX_TTL_S)


class _SecretRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    expires_after: _ExpiresAfter | None = None
    session: protocol.SessionFields | None = None


@dataclass(frozen=True)
class ClientSecret:
    value: str
    expires_at: int  # unix seconds
    session: protocol.SessionFields | None


@dataclass
class HttpAnswer:
    status: HTTPStatus
    body: bytes
    content_type: str
    headers: dict[str, str]


def _json(status: HTTPStatus, data: Any, **headers: str) -> HttpAnswer:
    return HttpAnswer(status, json.dumps(data).encode(), "application/json", headers)


def _error(
    status: HTTPStatus, message: str, code: str, type: str = "invalid_request_error", param: str | None = None
) -> HttpAnswer:
    """An error as OpenAI's REST API writes one (the SDK turns it into an `APIStatusError`)."""
    return _json(status, {"error": {"message": message, "type": type, "code": code, "param": param}})


def refused(status: HTTPStatus, code: str, message: str) -> HttpAnswer:
    """A request refused before it reaches an endpoint (its Origin, its body), as the endpoints refuse."""
    return _error(status, message, code)


def _session_error(exc: ProtocolError) -> HttpAnswer:
    """A session configuration that a session would refuse (`Peer.configure`): HTTP 400."""
    message = f"{exc.param}: {exc.message}" if exc.param else exc.message
    return _error(HTTPStatus.BAD_REQUEST, message, exc.code, param=exc.param)


class RealtimeHttp:
    """The endpoints above for one `Server`: its keys and its calls."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.keys: dict[str, ClientSecret] = {}
        self.calls: dict[str, Peer] = {}

    # -- authorization --------------------------------------------------------------------------------

    def key(self, given: str) -> ClientSecret | None:
        """The live client secret `given` names, else None (unknown or expired: it is forgotten)."""
        secret = self.keys.get(given)
        if secret is not None and secret.expires_at <= time.time():
            del self.keys[given]
            return None
        return secret

    def authorize(self, given: str, *, keys: bool) -> tuple[bool, ClientSecret | None]:
        """(allowed, the key used): the server's token, or (where `keys`) a live client secret. A server
        without a token allows anyone, and still honours a key's session configuration."""
        token = self.server.settings.token
        if token is not None and hmac.compare_digest(given.encode(), token.encode()):
            return True, None
        secret = self.key(given) if keys and given.startswith("ek_") else None
        return (secret is not None or token is None), secret

    # -- the endpoints --------------------------------------------------------------------------------

    @staticmethod
    def handles(path: str) -> bool:
        path = path.rstrip("/")
        return path.endswith(("/realtime/client_secrets", "/realtime/calls")) or (
            "/realtime/calls/" in path and path.endswith("/hangup")
        )

    async def handle(
        self, method: str, path: str, headers: Any, body: bytes | None, bearer: str | None
    ) -> HttpAnswer:
        """Answer a request to one of these endpoints (`handles(path)`)."""
        path, bearer = path.rstrip("/"), bearer or ""
        if path.endswith("/realtime/client_secrets"):
            return self._only_post(method) or self._client_secret(body, bearer)
        if path.endswith("/realtime/calls"):
            return self._only_post(method) or await self._call(headers, body, bearer)
        call_id = path.rpartition("/")[0].rpartition("/")[2]  # …/realtime/calls/{call_id}/hangup
        return self._only_post(method) or self._hangup(call_id, bearer)

    def _only_post(self, method: str) -> HttpAnswer | None:
        if method == "POST":
            return None
        answer = _error(HTTPStatus.METHOD_NOT_ALLOWED, "use POST", "method_not_allowed")
        answer.headers["Allow"] = "POST"
        return answer

    def _client_secret(self, body: bytes | None, bearer: str) -> HttpAnswer:
        allowed, _ = self.authorize(bearer, keys=False)  # a key cannot mint keys
        if not allowed:
            return _error(HTTPStatus.UNAUTHORIZED, "a valid server token is required", "invalid_api_key")
        try:
            request = _SecretRequest.model_validate_json(body or b"{}")
        except ValidationError as exc:
            first = exc.errors()[0]
            try:
                where = protocol.field_path(json.loads(body or b"{}"), first)
            except (ValueError, RecursionError):  # not JSON at all: no field to name
                where = None
            message = f"{where}: {first['msg']}" if where else first["msg"]
            return _error(HTTPStatus.BAD_REQUEST, message, "invalid_value", param=where)
        try:
            session = self.server.session_preview(request.session)
        except ProtocolError as exc:
            return _session_error(exc)
        ttl = (request.expires_after or _ExpiresAfter()).seconds
        secret = ClientSecret(f"ek_{secrets.token_urlsafe(24)}", int(time.time()) + ttl, request.session)
        self._forget_expired()
        while len(self.keys) >= MAX_KEYS:
            del self.keys[next(iter(self.keys))]
        self.keys[secret.value] = secret
        return _json(
            HTTPStatus.OK, {"value": secret.value, "expires_at": secret.expires_at, "session": session}
        )

    def _forget_expired(self) -> None:
        now = time.time()
        for value in [v for v, s in self.keys.items() if s.expires_at <= now]:
            del self.keys[value]

    async def _call(self, headers: Any, body: bytes | None, bearer: str) -> HttpAnswer:
        allowed, secret = self.authorize(bearer, keys=True)
        if not allowed:
            return _error(
                HTTPStatus.UNAUTHORIZED, "a valid token or client secret is required", "invalid_api_key"
            )
        content_type = headers.get("Content-Type", "")
        sessions = [secret.session] if secret is not None and secret.session is not None else []
        try:
            if content_type.lower().startswith("multipart/form-data"):
                fields = multipart_fields(content_type, body or b"")
                sdp = fields.get("sdp", "")
                if "session" in fields:  # over the key's configuration
                    sessions.append(protocol.SessionFields.model_validate_json(fields["session"]))
            else:
                sdp = (body or b"").decode("utf-8")
        except (ValueError, ValidationError) as exc:
            return _error(HTTPStatus.BAD_REQUEST, f"unreadable call request: {exc}", "invalid_value")
        if not sdp.strip():
            return _error(
                HTTPStatus.BAD_REQUEST, "an SDP offer is required (application/sdp, or 'sdp')", "invalid_sdp"
            )
        for session in sessions:
            try:
                self.server.session_preview(session)  # refused here, before a session slot is taken
            except ProtocolError as exc:
                return _session_error(exc)
        if not self.server.has_room():
            return _error(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "the server is at its session limit",
                "session_limit",
                "server_error",
            )
        peer = Peer(self.server.engine, None, self.server.settings.peer, sessions=sessions)
        self.server.peers.add(peer)
        try:
            await peer.open()
            answer = await peer.answer_call(sdp)
        except (OmniRtError, ProtocolError) as exc:
            await peer.close()
            self.server.peers.discard(peer)
            if isinstance(exc, ProtocolError):
                return _error(HTTPStatus.BAD_REQUEST, exc.message, exc.code)
            return _error(
                HTTPStatus.SERVICE_UNAVAILABLE, str(exc), protocol.unopened_code(exc), "server_error"
            )
        call_id = f"rtc_{peer.session_id.partition('_')[2]}"
        self.calls[call_id] = peer
        self.server.run_peer(peer, on_end=lambda: self.calls.pop(call_id, None))
        log.info("%s: call %s answered", peer.session_id, call_id)
        return HttpAnswer(
            HTTPStatus.CREATED,
            answer.encode(),
            "application/sdp",
            {"Location": f"/v1/realtime/calls/{call_id}"},
        )

    def _hangup(self, call_id: str, bearer: str) -> HttpAnswer:
        allowed, _ = self.authorize(bearer, keys=True)
        if not allowed:
            return _error(
                HTTPStatus.UNAUTHORIZED, "a valid token or client secret is required", "invalid_api_key"
            )
        peer = self.calls.pop(call_id, None)
        if peer is None:
            return _error(HTTPStatus.NOT_FOUND, f"no call {call_id!r}", "call_not_found")
        peer.hang_up()
        return _json(HTTPStatus.OK, {})
