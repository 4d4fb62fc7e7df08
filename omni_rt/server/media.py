"""One connection's WebRTC media: the offer, the reply track and what feeds it, the client's microphone.

The answer's rules are `webrtc.py`'s. Replies reach the track through one bounded queue of
(response, PCM or END, rate); the response rides along so that the audio of a cancelled one is
skipped even if it was queued before the cancel. The client's media is always read (aiortc queues
unread frames without bound): microphone frames go to `on_mic_frame`, synchronously, so the loop
never waits on anything but the next frame.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiortc import RTCPeerConnection
from aiortc.mediastreams import MediaStreamError

from omni_rt import wire
from omni_rt.server import webrtc
from omni_rt.server.protocol import ProtocolError
from omni_rt.server.track import AudioOutputTrack

if TYPE_CHECKING:
    from omni_rt.server.peer import PeerSettings
    from omni_rt.server.responses import Response

log = logging.getLogger("omni_rt.server")

CONNECT_TIMEOUT_S = 30.0  # from the answer to a connected WebRTC connection (see _connect_deadline)

AUDIO_QUEUE_SIZE = 256  # PCM chunks between the session and the track (a few seconds to a minute)
_END = object()  # end of one response's audio in the audio queue


class Media:
    def __init__(
        self,
        name: str,
        settings: PeerSettings,
        *,
        send: Callable[[dict[str, Any]], None],
        spawn: Callable[[Any, str], asyncio.Task],
        shutdown: Callable[[], None],
        closing: Callable[[], bool],
        attach_channel: Callable[[Any], bool],
        on_mic_frame: Callable[[Any], None],
    ) -> None:
        self.name = name
        self.settings = settings
        self._send, self._spawn, self._shutdown, self._closing = send, spawn, shutdown, closing
        self._attach_channel, self._on_mic_frame = attach_channel, on_mic_frame
        self.pc: RTCPeerConnection | None = None
        self.track: AudioOutputTrack | None = None  # the reply track, when the client receives audio
        self._audio: asyncio.Queue[tuple[Response, Any, int]] = asyncio.Queue(AUDIO_QUEUE_SIZE)

    async def answer(self, sdp: str, event_id: str | None = None) -> str:
        """The client's offer → the SDP answer. `ProtocolError`: a second offer, or an unusable one."""
        if self.pc is not None:
            raise ProtocolError(
                "renegotiation_unsupported", "this connection already has WebRTC", event_id=event_id
            )
        s = self.settings
        policy = s.ice_policy or webrtc.IcePolicy(None, tuple(s.ice_servers), s.ice_public_address)
        pc = self.pc = webrtc.peer_connection(policy)  # set first: close() closes it
        pc.on("datachannel", self._on_datachannel)
        pc.on("track", self._on_remote_track)

        connected = asyncio.Event()

        @pc.on("connectionstatechange")
        def _state() -> None:
            if pc.connectionState == "connected":
                connected.set()
            if pc.connectionState in ("failed", "closed") and not self._closing():
                log.info("peer %s: WebRTC %s", self.name, pc.connectionState)
                self._shutdown()

        track = AudioOutputTrack(
            idle=s.idle,
            start_lead_ms=s.start_lead_ms or 0,
            on_started=self._on_audio_started,
            on_stopped=self._on_audio_stopped,
        )
        try:
            answer, sends = await webrtc.answer_offer(pc, sdp, track, policy)
        except ValueError as exc:
            track.stop()
            raise ProtocolError("invalid_sdp", str(exc), param="sdp", event_id=event_id, fatal=True) from None
        if pc.sctp is None:  # no data channel in the offer: none will ever open
            self._attach_channel(None)
        self._spawn(self._connect_deadline(connected), "connect deadline")
        if sends:
            self.track = track
            self._spawn(self._feed_track(track), "track feeder")
        else:
            # No audio, or send-only audio (a microphone, nothing to play): nobody would read the
            # track, so the reply's audio goes as events instead of piling up in front of it.
            track.stop()
        return answer

    async def _connect_deadline(self, connected: asyncio.Event) -> None:
        """A connection not up within CONNECT_TIMEOUT_S has failed. An offer without candidates (sent
        before ICE gathering finished) leaves it "new" for good, where a call would hold its session
        slot until the server stops; aioice fails the others in about a minute."""
        try:
            await asyncio.wait_for(connected.wait(), CONNECT_TIMEOUT_S)
        except TimeoutError:
            if not self._closing():
                log.info("peer %s: WebRTC not connected within %g s", self.name, CONNECT_TIMEOUT_S)
                self._shutdown()

    # -- the reply's audio ------------------------------------------------------------------------------

    async def play(self, response: Response, pcm: Any, rate: int) -> None:
        await self._audio.put((response, pcm, rate))

    async def end(self, response: Response) -> None:
        await self._audio.put((response, _END, 0))

    def drop_queued(self) -> None:
        """Nothing queued for the track is played; the track drops what it holds."""
        while not self._audio.empty():
            self._audio.get_nowait()
        if self.track is not None:
            self.track.clear()

    async def _feed_track(self, track: AudioOutputTrack) -> None:
        while True:
            response, pcm, rate = await self._audio.get()
            if response.cancelled:
                continue  # queued (or put while a cancel cleared the queue) before the cancel: drop it
            try:
                if pcm is _END:
                    await track.end_response(response.id)
                else:
                    await track.write(pcm, rate, response.id)
            except MediaStreamError:
                return

    def _on_audio_started(self, response_id: str) -> None:
        self._send(wire.output_audio_buffer("started", response_id))

    def _on_audio_stopped(self, response_id: str) -> None:
        self._send(wire.output_audio_buffer("stopped", response_id))

    # -- the client's side ------------------------------------------------------------------------------

    def _on_datachannel(self, channel: Any) -> None:
        if not self._attach_channel(channel):
            channel.close()

    def _on_remote_track(self, track: Any) -> None:
        self._spawn(self._consume(track), "microphone" if track.kind == "audio" else "video")

    async def _consume(self, track: Any) -> None:
        """Always read the client's media (video is declined, so none should come)."""
        try:
            while True:
                frame = await track.recv()
                if track.kind == "audio":
                    self._on_mic_frame(frame)
        except MediaStreamError:
            pass

    # -- closing ----------------------------------------------------------------------------------------

    async def stop_track(self) -> None:
        if self.track is not None:
            self.track.stop()

    async def close(self) -> None:
        if self.pc is not None:
            await self.pc.close()
