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

from websockets.asyncio.server import ServerConnection

MAX_HEAD_BYTES = 16 * 1024  # websockets' own limits are 8 KiB a line, 128 headers
MAX_BODY_BYTES = 256 * 1024  # an SDP offer is a few kB; a session config less


class BodyConnection(ServerConnection):
    body: bytes | None = None  # the request's body, once read (None: it had none)
    body_error: str | None = None  # why the body was not read (too large, malformed length)

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
        if length is None:  # no body: a WebSocket upgrade, a GET
            self._pass(bytes(self._head))
            return
        if length < 0 or length > MAX_BODY_BYTES:
            self.body_error = "the request body is too large" if length > 0 else "a bad Content-Length"
            self.body = b""
            self._pass(_without_length(head), discard=True)  # process_request answers it (413 / 400)
            return
        if len(rest) < length:
            return  # more of the body to come
        self.body = rest[:length]
        self._pass(_without_length(head), discard=True)

    def _pass(self, data: bytes, discard: bool = False) -> None:
        self._passthrough = True
        self._head = bytearray()
        super().data_received(data)
        self._discard = discard


def _content_length(head: bytes) -> int | None:
    values = [
        line.split(b":", 1)[1].strip()
        for line in head.split(b"\r\n")[1:]
        if line.lower().startswith(b"content-length:")
    ]
    if not values or values == [b"0"] * len(values):
        return None
    if len(set(values)) != 1 or not values[0].isdigit():
        return -1
    return int(values[0])


def _without_length(head: bytes) -> bytes:
    lines = head.split(b"\r\n")
    return b"\r\n".join(line for line in lines if not line.lower().startswith(b"content-length:"))


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
