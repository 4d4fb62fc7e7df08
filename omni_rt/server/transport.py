"""How one connection's events travel: the WebSocket, the WebRTC data channel, or both.

Server events go on the data channel once it is open, else on the socket (a call, with no socket,
holds them until its channel opens). Client events from either arrive in the peer's one bounded
inbox. A client that stops reading is dropped, said in one log line. The socket's close handshake is
bounded: websockets' `close()` waits for the socket to drain, and a client that stopped reading
never drains it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from omni_rt.server import protocol
from omni_rt.server.protocol import ProtocolError

if TYPE_CHECKING:
    from websockets.asyncio.server import ServerConnection

log = logging.getLogger("omni_rt.server")

OUTBOX_SIZE = 1024  # server events waiting for a slow socket; past that the client is dropped
# Socket messages read ahead of the peer, in bytes (a message may be 2 MiB, a whole clip's append):
# past this, reading waits, as it does for a full inbox (64 messages), so the socket pushes back.
INBOX_BYTES = 8 * 1024 * 1024
MAX_CHANNEL_BUFFERED = 8 * 1024 * 1024  # bytes a data channel may hold unsent before the peer is dropped
CLOSE_TIMEOUT_S = 2.0  # the close handshake; then the connection is cut

Inbox = asyncio.Queue  # of (raw message, "socket" | "channel"), or None: the connection ends


class Transport:
    def __init__(
        self, ws: ServerConnection | None, name: str, inbox: Inbox, shutdown: Callable[[], None]
    ) -> None:
        """`ws` None: a call, whose events travel on its data channel alone. `shutdown` asks the
        peer's main loop to end (the socket is gone, the client too slow)."""
        self.ws = ws
        self.name = name
        self.inbox = inbox
        self.shutdown = shutdown
        self.channel: Any = None  # the events RTCDataChannel once the client opens it
        self.closing = False  # the peer is closing: only errors still go out
        self._outbox: asyncio.Queue[str] = asyncio.Queue(OUTBOX_SIZE)
        self._early: list[str] = []  # a call's events before its data channel opens
        self._channelless = False  # a call whose offer has no data channel (attach_channel(None))
        self._dropping = False
        self._inbox_bytes = 0  # of the socket's messages in the inbox
        self._inbox_room = asyncio.Event()

    def send(self, event: dict[str, Any]) -> None:
        """One server event to the client: on the data channel when it is open, else on the socket."""
        if self.closing and event.get("type") != "error":
            return
        data = json.dumps(event)
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            if channel.bufferedAmount > MAX_CHANNEL_BUFFERED:
                self._drop_slow_client("data channel")
                return
            try:
                channel.send(data)
                return
            except ValueError:
                # Over the client's max-message-size (256 KiB in browsers): the socket has no such
                # limit, and the client reads both. A call has none: the client hears what it missed.
                if self.ws is None:
                    self._too_large(event["type"], len(data))
                    return
                log.info("peer %s: a %d-byte %s goes on the socket", self.name, len(data), event["type"])
        self.send_socket(data)

    def _too_large(self, kind: str, size: int) -> None:
        """An event the data channel of a call cannot carry: an error in its place, the call goes on."""
        log.warning("peer %s: a %d-byte %s does not fit the data channel", self.name, size, kind)
        too_large = ProtocolError(
            "event_too_large",
            f"a {kind} event of {size} bytes is over the data channel's max-message-size: it was not sent",
            type="server_error",
        )
        self.channel.send(json.dumps(protocol.error(too_large)))

    def send_socket(self, data: str) -> None:
        """On the socket (signaling, and what does not fit the channel); a call's wait for its channel."""
        if self.ws is None:
            channel = self.channel
            if channel is not None and channel.readyState == "open":
                try:
                    channel.send(data)
                except ValueError:  # as in send(): a call has no socket to carry it
                    self._too_large(json.loads(data).get("type", "?"), len(data))
            elif self._channelless:
                pass  # a voice-only call: its audio is all it has
            elif len(self._early) < OUTBOX_SIZE:
                self._early.append(data)
            else:
                self._drop_slow_client("data channel")
            return
        try:
            self._outbox.put_nowait(data)
        except asyncio.QueueFull:
            self._drop_slow_client("socket")

    def attach_channel(self, channel: Any) -> bool:
        """The client's data channel: "events" (omni_rt's name) or "oai-events" (OpenAI's), the first
        one only. False: not one to use (the caller closes it). None: the offer has no data channel,
        so none will come: a call's events have nowhere to go and are dropped (`_channelless`) rather
        than held for it until the hold is full and the call is cut as a client that stopped reading."""
        if channel is None:
            self._channelless = True
            self._early = []
            return False
        if channel.label not in ("events", "oai-events") or self.channel is not None:
            return False
        self.channel = channel
        channel.on("message", self._on_channel_message)
        if self.ws is None:  # a call: its events waited for this channel; it ends when the channel does
            channel.on("open", self._flush_early)
            channel.on("close", self.shutdown)
            if channel.readyState == "open":
                self._flush_early()
        return True

    def _flush_early(self) -> None:
        early, self._early = self._early, []
        for data in early:
            self.send_socket(data)

    def _drop_slow_client(self, where: str) -> None:
        """A client that stopped reading: said once (a reply sends many events after the first that
        does not fit), then the main loop ends the connection."""
        if not self._dropping:
            self._dropping = True
            log.warning("peer %s: %s not drained, dropping the client", self.name, where)
        self.shutdown()

    def _on_channel_message(self, raw: str | bytes) -> None:
        try:
            self.inbox.put_nowait((raw, "channel"))
        except asyncio.QueueFull:
            self.send(protocol.error(ProtocolError("rate_limited", "too many events in flight; slow down")))

    # -- the socket's tasks -------------------------------------------------------------------------------

    async def write_socket(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            while True:
                data = await self._outbox.get()
                try:
                    await self.ws.send(data)
                finally:
                    self._outbox.task_done()
        except ConnectionClosed:
            self.shutdown()

    async def read_socket(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            async for raw in self.ws:
                await self.inbox.put((raw, "socket"))  # waits when full: back-pressure on the socket
                self._inbox_bytes += len(raw)
                while self._inbox_bytes > INBOX_BYTES:  # and when it holds too many bytes
                    self._inbox_room.clear()
                    await self._inbox_room.wait()
        except ConnectionClosed:
            pass
        finally:
            self.shutdown()

    def taken(self, raw: str | bytes, source: str) -> None:
        """The peer took a message from the inbox: a socket message's bytes no longer count."""
        if source == "socket":
            self._inbox_bytes -= len(raw)
            self._inbox_room.set()

    # -- closing ------------------------------------------------------------------------------------------

    async def close(self, code: int = 1000) -> None:
        """The close handshake, bounded."""
        if self.ws is None:
            return
        try:
            await asyncio.wait_for(self.ws.close(code), CLOSE_TIMEOUT_S)
        except TimeoutError:
            self.ws.transport.abort()

    async def fail(self, exc: ProtocolError, code: int) -> None:
        """The error that explains it, on the socket (where it is sure to arrive first), then close with
        `code`; queued events get a moment to leave first. A call just ends."""
        self.send_socket(json.dumps(protocol.error(exc)))
        if self.ws is None:
            self.shutdown()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._outbox.join(), 1.0)
        await self.close(code)
