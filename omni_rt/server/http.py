"""HTTP requests with a body, on the WebSocket server's port.

`websockets` answers plain HTTP from its handshake hook, but its request parser refuses any request
with a body ("unsupported request body"), and OpenAI's Realtime endpoints are POSTs with one
(`/v1/realtime/client_secrets` JSON, `/v1/realtime/calls` SDP). `BodyConnection` is websockets'
connection class (its documented `create_connection` extension point) that reads a request's
`Content-Length` body itself, bounded, and hands websockets the head alone: `process_request` then
sees the request as usual, with the body in `connection.body`. Anything else (a WebSocket upgrade, a
GET) passes through untouched.
"""

from __future__ import annotations

import email.parser
import email.policy
from http import HTTPStatus

from websockets.asyncio.server import ServerConnection

MAX_HEAD_BYTES = 16 * 1024  # websockets' own limits are 8 KiB a line, 128 headers
MAX_BODY_BYTES = 256 * 1024  # an SDP offer is a few kB; a session config less


class BodyConnection(ServerConnection):
    body: bytes | None = None  # the request's body, once read (None: it had none)
    # Why the body was not read (too large, a malformed length, chunked): the answer's status, an
    # OpenAI error code and a message; process_request answers it.
    body_error: tuple[HTTPStatus, str, str] | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head = bytearray()
        self._passthrough = False
        self._discard = False  # a request with a body was handed on: what follows is not websockets'

    def data_received(self, data: bytes) -> None:
        if self._discard:
            return  # the rest of a refused body, or bytes after one (the answer closes the connection)
        if self._passthrough:
            super().data_received(data)
            return
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > MAX_HEAD_BYTES:
                self._pass(bytes(self._head))  # websockets refuses it with its own error
            return
        head, rest = bytes(self._head[: end + 4]), bytes(self._head[end + 4 :])
        length = _content_length(head)
        if _header_lines(head, b"transfer-encoding:"):
            # websockets drops such a request unanswered; a streamed fetch() body comes so
            self._refuse(
                head, HTTPStatus.LENGTH_REQUIRED, "length_required", "send the body with a Content-Length"
            )
            return
        if length is None:  # no body: a WebSocket upgrade, a GET
            self._pass(bytes(self._head))
            return
        if length < 0:
            self._refuse(head, HTTPStatus.BAD_REQUEST, "invalid_request", "a malformed Content-Length")
            return
        if length > MAX_BODY_BYTES:
            too_large = f"the request body is over {MAX_BODY_BYTES} bytes"
            self._refuse(head, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "request_too_large", too_large)
            return
        if len(rest) < length:
            return  # more of the body to come
        self.body = rest[:length]
        self._pass(_without_body_headers(head), discard=True)

    def _refuse(self, head: bytes, status: HTTPStatus, code: str, message: str) -> None:
        """A body not to be read: the head goes on alone, and process_request answers with the error."""
        self.body_error = (status, code, message)
        self.body = b""
        self._pass(_without_body_headers(head), discard=True)

    def _pass(self, data: bytes, discard: bool = False) -> None:
        self._passthrough = True
        self._head = bytearray()
        super().data_received(data)
        self._discard = discard


def _header_lines(head: bytes, name: bytes) -> list[bytes]:
    """The values of header `name` (lower case, with its colon) in a request head."""
    return [
        line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")[1:] if line.lower().startswith(name)
    ]


def _content_length(head: bytes) -> int | None:
    values = _header_lines(head, b"content-length:")
    if not values or values == [b"0"] * len(values):
        return None
    if len(set(values)) != 1 or not values[0].isdigit():
        return -1
    return int(values[0])


def _without_body_headers(head: bytes) -> bytes:
    """The head without what describes a body: websockets refuses a request that has one."""
    lines = head.split(b"\r\n")
    return b"\r\n".join(
        line for line in lines if not line.lower().startswith((b"content-length:", b"transfer-encoding:"))
    )


def multipart_fields(content_type: str, body: bytes) -> dict[str, str]:
    """The text fields of a `multipart/form-data` body, by name; `ValueError` if it is not one."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    if not message.is_multipart():
        raise ValueError("not a multipart/form-data body")
    fields = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name:
            payload = part.get_payload(decode=True) or b""
            fields[str(name)] = payload.decode("utf-8")
    return fields
