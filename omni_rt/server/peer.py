"""One client connection ↔ one `Session`: signaling, the events both ways, the media tracks.

A client opens the WebSocket `/ws`. The server opens a Session for it at once and says
`session.created`. The client may then send `webrtc.offer` to get audio over WebRTC (an outgoing track,
its microphone heard, and a data channel named `events`; the offer/answer rules are `webrtc.py`'s), or
stay on the socket alone, where audio comes as base64 PCM16 in `response.output_audio.delta` events.

Speech input: microphone frames and `input_audio_buffer.append` audio go to one `InputAudioBuffer`
(`speech.py`: 16 kHz, server VAD). Its turns become user items and, with server VAD, responses
(`respond(audio=...)`); speech that starts during a reply cuts it (barge-in). All of it is synchronous
on the event loop, so the microphone loop never waits on anything but the next frame.

Every client event, from the socket or the data channel, goes through one bounded inbox and is handled
in order by one loop. Replies go out on the data channel once it is open, else on the socket. The
connection lives as long as the socket: when it closes (or WebRTC fails), the response in progress is
cancelled, which stops its GPU work, and the session is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from aiortc import RTCPeerConnection
from aiortc.mediastreams import MediaStreamError

from omni_rt.audio.vad import SpeechStarted, SpeechStopped, Turn
from omni_rt.errors import OmniRtError
from omni_rt.events import (
    InputAudioBufferCleared,
    InputAudioBufferCommitted,
    InputAudioBufferSpeechStarted,
    InputAudioBufferSpeechStopped,
)
from omni_rt.server import protocol, webrtc
from omni_rt.server.protocol import ProtocolError
from omni_rt.server.speech import SPEECH_RATE, InputAudioBuffer, InputRate, TurnDetection
from omni_rt.server.track import FRAME_SAMPLES, AudioOutputTrack, Idle
from omni_rt.server.track import SAMPLE_RATE as TRACK_RATE
from omni_rt.server.transcription import InputTranscriber, transcription_update
from omni_rt.server.turns import SpokenTurnClock, when_answered

if TYPE_CHECKING:
    from websockets.asyncio.server import ServerConnection

log = logging.getLogger("omni_rt.server")

INBOX_SIZE = 64  # client events waiting to be handled; a client that floods gets an error
OUTBOX_SIZE = 1024  # server events waiting for a slow socket; past that the client is dropped
AUDIO_QUEUE_SIZE = 256  # PCM chunks between the session and the track (a few seconds to a minute)
MAX_CHANNEL_BUFFERED = 8 * 1024 * 1024  # bytes a data channel may hold unsent before the peer is dropped
SESSION_SAMPLE_RATE = 24000  # what socket clients receive (the model's own rate); the track makes 48 kHz
KEPT_ITEMS = 64  # assistant items remembered for conversation.item.truncate
CLOSE_TIMEOUT_S = 2.0  # the close handshake; then the connection is cut
_END = object()  # end of one response's audio in the audio queue


@dataclass(frozen=True)
class PeerSettings:
    """What every connection is allowed and how it behaves; the server passes one to each peer."""

    model: str = "omni_rt"
    voice: str = "ethan"
    instructions: str | None = None
    ice_servers: Sequence[str] = ()
    idle: Idle = "silence"  # see AudioOutputTrack: "nothing" grows the browser's jitter buffer
    max_message_bytes: int = protocol.MAX_MESSAGE_BYTES
    max_output_tokens: int = 1024  # a client may ask for fewer, never more
    # The Talker stops at its end-of-speech code; this caps a reply that never gets there (random
    # weights do not) at 60 s of audio (a codec frame is 80 ms).
    max_audio_frames: int = 750
    # Server VAD for new connections (a client changes it with session.update; None: off).
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    max_turn_ms: int = 30_000  # longest user turn: VAD ends it there; without VAD the buffer is full
    # User input waiting for the next response (text items, committed speech): past these, more is
    # refused (pending_input_full), so a client that never asks for a response cannot grow memory.
    max_pending_text_chars: int = 4 * protocol.MAX_TEXT_CHARS
    max_pending_audio_ms: int = 60_000


@dataclass
class _Response:
    item_id: str
    task: asyncio.Task | None = None
    id: str | None = None  # the session's response id, once it says response.created
    cancelled: bool = False
    transcript: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    audio_ms: float = 0.0  # audio the session made for it
    played_ms: float | None = None  # what the client said it played (conversation.item.truncate)
    spoken: SpokenTurnClock | None = None  # the spoken turn it answers: end_of_speech/voice_to_voice


class Peer:
    def __init__(self, engine: Any, ws: ServerConnection, settings: PeerSettings) -> None:
        self.engine = engine
        self.ws = ws
        self.settings = settings
        self.session_id = protocol.new_id("sess")
        self.voice = settings.voice
        self.instructions = settings.instructions or ""
        self.output_modalities: list[str] = ["audio"]
        self.max_output_tokens: int | str = "inf"  # "inf": the server's limit

        self.session: Any = None
        self._session_stack: contextlib.AsyncExitStack | None = None
        self._inbox: asyncio.Queue[tuple[str | bytes, str] | None] = asyncio.Queue(INBOX_SIZE)
        self._outbox: asyncio.Queue[str] = asyncio.Queue(OUTBOX_SIZE)
        self._tasks: set[asyncio.Task] = set()
        self._closed = asyncio.Event()
        self._closing = False
        self._task_failed = False  # one of this peer's tasks raised: the connection ends with 1011

        self.pc: RTCPeerConnection | None = None
        self.channel: Any = None  # the `events` RTCDataChannel once the client opens it
        self.track: AudioOutputTrack | None = None
        # (response, pcm or _END, sample rate): the response rides along so a cancelled one is skipped.
        self._audio: asyncio.Queue[tuple[_Response, Any, int]] = asyncio.Queue(AUDIO_QUEUE_SIZE)

        self._pending_input: list[str] = []  # user text since the last response.create
        self._pending_audio: list[np.ndarray] = []  # committed user speech (16 kHz) since then
        self._last_item_id: str | None = None
        self._response: _Response | None = None
        self._respond_when_idle = False  # a VAD turn ended during a response: answer it after
        self._spoken_turn: SpokenTurnClock | None = None  # the last detected turn, for the next response
        self._watched_answer: Any = None  # semantic_vad's pending answer that _on_turn_answer awaits
        self._items: OrderedDict[str, _Response] = OrderedDict()  # recent assistant items by id

        self.turn_detection = settings.turn_detection
        self.input = InputAudioBuffer(self.turn_detection, settings.max_turn_ms)
        self.transcriber = InputTranscriber(engine, self.send, self._spawn)  # audio.input.transcription
        self._input_rate = InputRate()  # appends and microphone frames together
        self._input_item_id: str | None = None  # the user item the turn being spoken will become
        self._input_full_reported = False  # the microphone overran a buffer without VAD: said once
        self._input_failed = False  # speech input hit a bug: the microphone is read and dropped

        # Counters: what the client sent us as audio, and what we played to it.
        self.input_audio_frames = 0
        self.responses = 0

    # -- lifetime ---------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve this connection until the socket closes or the peer fails; always cleans up."""
        try:
            self._spawn(self._write_socket(), "socket writer")
            try:
                await self._open_session()
            except OmniRtError as exc:
                await self._fail_now(
                    ProtocolError("session_unavailable", str(exc), type="server_error"), 1013
                )
                return
            self.send(protocol.session_created(self._session_object()))
            self._spawn(self._read_socket(), "socket reader")
            while (item := await self._inbox.get()) is not None:
                raw, source = item
                try:
                    await self._handle(raw, source)
                except ProtocolError as exc:
                    if not exc.fatal:
                        self.send(protocol.error(exc))
                        continue
                    # The socket is what closes: the error goes there, where it is sure to arrive first.
                    await self._fail_now(exc, 1009 if exc.code == "message_too_large" else 1008)
                    return
            if self._task_failed:
                await self._fail_now(
                    ProtocolError("server_error", "internal error", type="server_error"), 1011
                )
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug here must cost this client its connection, never the server.
            log.exception("peer %s failed", self.session_id)
            await self._fail_now(ProtocolError("server_error", "internal error", type="server_error"), 1011)
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop everything this peer started. Safe to call more than once, from anywhere."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        try:
            await self._stop_response()
            if self.track is not None:
                self.track.stop()
            current = asyncio.current_task()
            tasks = [t for t in self._tasks if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.pc is not None:
                await self.pc.close()
            if self._session_stack is not None:
                await self._session_stack.aclose()
                self._session_stack = None
                self.session = None
            await self._close_socket()
        finally:
            self._closed.set()

    async def _close_socket(self, code: int = 1000) -> None:
        """The close handshake, bounded: websockets' close() first waits for the socket to drain,
        without a limit, and a client that stops reading never drains it."""
        try:
            await asyncio.wait_for(self.ws.close(code), CLOSE_TIMEOUT_S)
        except TimeoutError:
            self.ws.transport.abort()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=f"{self.session_id} {name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        # A bug in a task (the track feeder, the microphone) would otherwise end it silently and
        # leave the client waiting: it costs this client its connection, as a bug in run() does.
        log.error("peer %s: %s failed", self.session_id, task.get_name(), exc_info=task.exception())
        self._task_failed = True
        self._shutdown()

    def _shutdown(self) -> None:
        """Ask the main loop to end (socket gone, WebRTC failed, client too slow)."""
        with contextlib.suppress(asyncio.QueueFull):
            self._inbox.put_nowait(None)
        if self._inbox.full():
            # The inbox is full of client events: make room for the sentinel; they will not be served.
            while not self._inbox.empty():
                self._inbox.get_nowait()
            self._inbox.put_nowait(None)

    async def _open_session(self) -> None:
        stack = contextlib.AsyncExitStack()
        kwargs: dict[str, Any] = {"voice": self.voice, "output_sample_rate": SESSION_SAMPLE_RATE}
        if self.instructions:
            kwargs["instructions"] = self.instructions
        self.session = await stack.enter_async_context(self.engine.session(**kwargs))
        self._session_stack = stack

    def _session_object(self) -> dict[str, Any]:
        session = protocol.session_object(
            self.session_id,
            self.settings.model,
            self.voice,
            self.instructions,
            self.output_modalities,
            SESSION_SAMPLE_RATE,
            self.max_output_tokens,
            None if self.turn_detection is None else self.turn_detection.to_wire(),
        )
        if self.transcriber.setting is not None:
            session["audio"]["input"]["transcription"] = self.transcriber.setting
        return session

    # -- transport --------------------------------------------------------------------------------------

    def send(self, event: dict[str, Any]) -> None:
        """One server event to the client: on the data channel when it is open, else on the socket."""
        if self._closing and event.get("type") != "error":
            return
        data = json.dumps(event)
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            if channel.bufferedAmount > MAX_CHANNEL_BUFFERED:
                log.warning("peer %s: data channel not drained, dropping the client", self.session_id)
                self._shutdown()
                return
            try:
                channel.send(data)
                return
            except ValueError:
                # Over the client's max-message-size (256 KiB in browsers): the socket has no such
                # limit, and the client reads both.
                log.info(
                    "peer %s: a %d-byte %s goes on the socket", self.session_id, len(data), event["type"]
                )
        self._send_socket(data)

    def _send_socket(self, data: str) -> None:
        try:
            self._outbox.put_nowait(data)
        except asyncio.QueueFull:
            log.warning("peer %s: socket not drained, dropping the client", self.session_id)
            self._shutdown()

    async def _write_socket(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            while True:
                data = await self._outbox.get()
                try:
                    await self.ws.send(data)
                finally:
                    self._outbox.task_done()
        except ConnectionClosed:
            self._shutdown()

    async def _read_socket(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            async for raw in self.ws:
                await self._inbox.put((raw, "socket"))  # waits when full: back-pressure on the socket
        except ConnectionClosed:
            pass
        finally:
            self._shutdown()

    def _on_channel_message(self, raw: str | bytes) -> None:
        try:
            self._inbox.put_nowait((raw, "channel"))
        except asyncio.QueueFull:
            self.send(protocol.error(ProtocolError("rate_limited", "too many events in flight; slow down")))

    async def _flush_and_close(self, code: int) -> None:
        """Give queued events (the error that explains the close) a moment to leave, then close."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._outbox.join(), 1.0)
        await self._close_socket(code)

    async def _fail_now(self, exc: ProtocolError, code: int) -> None:
        self._send_socket(json.dumps(protocol.error(exc)))
        await self._flush_and_close(code)

    # -- client events ----------------------------------------------------------------------------------

    async def _handle(self, raw: str | bytes, source: str) -> None:
        if isinstance(raw, bytes) and source == "socket":
            raise ProtocolError(
                "invalid_event", "binary messages are not accepted: send JSON text", fatal=True
            )
        event = protocol.parse_client_event(raw, self.settings.max_message_bytes)
        match event:
            case protocol.WebRtcOffer():
                if source != "socket":
                    raise ProtocolError(
                        "invalid_event", "send webrtc.offer on the WebSocket", event_id=event.event_id
                    )
                await self._on_offer(event)
            case protocol.SessionUpdate():
                await self._on_session_update(event)
            case protocol.ConversationItemCreate():
                self._on_item_create(event)
            case protocol.ResponseCreate():
                self._on_response_create(event)
            case protocol.ResponseCancel():
                await self._on_response_cancel(event)
            case protocol.OutputAudioBufferClear():
                await self._on_audio_clear(event)
            case protocol.InputAudioBufferAppend():
                self._on_audio_append(event)
            case protocol.InputAudioBufferCommit():
                self._on_audio_commit(event)
            case protocol.InputAudioBufferClear():
                self.input.clear()
                self._input_item_id = None
                self.send(InputAudioBufferCleared().to_wire())
            case protocol.ConversationItemTruncate():
                self._on_item_truncate(event)

    async def _on_session_update(self, event: protocol.SessionUpdate) -> None:
        s = event.session
        voice = s.voice or (s.audio.output.voice if s.audio and s.audio.output else None)
        instructions = s.instructions
        changed = (voice is not None and voice != self.voice) or (
            instructions is not None and instructions != self.instructions
        )
        if changed and self._response is not None:
            raise ProtocolError(
                "conversation_already_has_active_response",
                "voice and instructions cannot change while a response is in progress",
                event_id=event.event_id,
            )
        if voice is not None and hasattr(self.engine, "speaker_id"):
            try:
                self.engine.speaker_id(voice)  # checked before the current session is given up
            except OmniRtError as exc:
                raise ProtocolError(
                    "invalid_value", str(exc), param="session.audio.output.voice", event_id=event.event_id
                ) from None
        given, detection = event.turn_detection()
        transcription_given, transcription = transcription_update(event)
        # Valid: apply all of it.
        if transcription_given:
            self.transcriber.configure(transcription)
        if given:
            self._set_turn_detection(None if detection is None else TurnDetection.from_wire(detection))
        modalities = s.output_modalities or s.modalities
        if modalities is not None:
            self.output_modalities = list(dict.fromkeys(modalities))
        if s.max_output_tokens is not None:
            self.max_output_tokens = s.max_output_tokens
        if changed:
            self.voice = voice or self.voice
            self.instructions = instructions if instructions is not None else self.instructions
            # A Session's voice and system prompt are fixed when it opens: open a fresh one (the
            # conversation starts over, as it would with a new system prompt anyway). Meanwhile
            # there is no session: a spoken turn that ends now waits for the new one.
            self.session = None
            if self._session_stack is not None:
                await self._session_stack.aclose()
                self._session_stack = None
            try:
                await self._open_session()
            except OmniRtError as exc:  # the engine stopped, or lost its slot to another client
                raise ProtocolError(
                    "session_unavailable", str(exc), type="server_error", event_id=event.event_id, fatal=True
                ) from None
        self.send(protocol.session_updated(self._session_object()))
        if self._respond_when_idle and self._response is None:
            self._start_response(self._max_tokens(), list(self.output_modalities))

    def _on_item_create(self, event: protocol.ConversationItemCreate) -> None:
        item = event.item
        if item.role != "user":
            raise ProtocolError(
                "invalid_value",
                "only user messages can be added; set instructions with session.update",
                param="item.role",
                event_id=event.event_id,
            )
        try:
            text = protocol.user_text(item)
        except ProtocolError as exc:
            exc.event_id = event.event_id
            raise
        pending = sum(map(len, self._pending_input)) + len(text)
        if pending > self.settings.max_pending_text_chars:
            raise ProtocolError(
                "pending_input_full",
                f"at most {self.settings.max_pending_text_chars} characters of user text wait for a "
                f"response ({pending} with this message): send response.create, or a shorter message",
                event_id=event.event_id,
            )
        item_id = item.id or protocol.new_id("item")
        self._pending_input.append(text)
        wire = protocol.item_object(item_id, "user", text)
        self.send(protocol.conversation_item_added(wire, self._last_item_id))
        self.send(protocol.conversation_item_done(wire, self._last_item_id))
        self._last_item_id = item_id

    def _on_response_create(self, event: protocol.ResponseCreate) -> None:
        if self._response is not None:
            raise ProtocolError(
                "conversation_already_has_active_response",
                "a response is already in progress; cancel it first",
                event_id=event.event_id,
            )
        if not self._pending_input and not self._pending_audio:
            raise ProtocolError(
                "no_input",
                "nothing to respond to: add a user message with conversation.item.create "
                "or commit the input audio buffer first",
                event_id=event.event_id,
            )
        self._start_response(
            self._max_tokens(event.response.max_output_tokens),
            list(event.response.output_modalities or self.output_modalities),
        )

    def _start_response(self, max_tokens: int, modalities: list[str]) -> None:
        """Answer everything the user added since the last response: text, speech, or both."""
        text = "\n".join(self._pending_input) or None
        audio = np.concatenate(self._pending_audio) if self._pending_audio else None
        self._pending_input.clear()
        self._pending_audio.clear()
        self._respond_when_idle = False
        if self.track is not None and self.track.response_id is not None:
            # The previous reply is still playing (playout is real time, generation faster): the
            # conversation has moved on, so its unplayed audio goes rather than delaying the new reply.
            playing = self.track.response_id
            self._drop_queued_audio()
            self.send(protocol.output_audio_buffer("cleared", playing))
        response = _Response(item_id=protocol.new_id("item"), spoken=self._spoken_turn)
        self.transcriber.hold()  # until its first audio: transcripts never come before the answer
        self._spoken_turn = None
        self._response = response
        self._items[response.item_id] = response
        while len(self._items) > KEPT_ITEMS:
            self._items.popitem(last=False)
        response.task = self._spawn(
            self._run_response(response, text, audio, max_tokens, modalities), "response"
        )

    async def _on_response_cancel(self, event: protocol.ResponseCancel) -> None:
        response = self._response
        if response is None or (event.response_id and event.response_id != response.id):
            raise ProtocolError(
                "response_cancel_not_active",
                "there is no response in progress to cancel",
                event_id=event.event_id,
            )
        await self._cancel_response(response, event.event_id)

    async def _on_audio_clear(self, event: protocol.OutputAudioBufferClear) -> None:
        """Silence the track now: the reply in progress is cancelled, or the one still playing cut off."""
        if self.track is None:
            raise ProtocolError(
                "unsupported_event",
                "output_audio_buffer.clear needs a WebRTC audio track",
                event_id=event.event_id,
            )
        self._interrupt()

    def _interrupt(self) -> None:
        """Barge-in, at once: the reply in progress is cut and cancelled, or the one still playing cut
        off. Nothing here waits, so the microphone keeps being read; the model stops in a task."""
        response = self._response
        if response is not None:
            if self._cut(response) and self.session is not None:
                self._spawn(self._cancel_session(self.session), "barge-in")
            return
        playing = self.track.response_id if self.track is not None else None
        if playing is not None:
            self._record_played(next((r for r in self._items.values() if r.id == playing), None))
        self._drop_queued_audio()
        if playing is not None:
            self.send(protocol.output_audio_buffer("cleared", playing))

    def _record_played(self, response: _Response | None) -> None:
        """A reply cut off on the track: the client heard what was sent of it, and the item says so,
        as if the client had sent conversation.item.truncate (OpenAI's WebRTC sessions do the same)."""
        track = self.track
        if response is None or track is None or track.response_id is None or track.response_id != response.id:
            return
        response.played_ms = track.response_frames * 1000.0 * FRAME_SAMPLES / TRACK_RATE
        self.send(protocol.conversation_item_truncated(response.item_id, 0, round(response.played_ms)))

    async def _cancel_session(self, session: Any, event_id: str | None = None) -> None:
        try:
            await session.cancel()
        except OmniRtError as exc:  # the pipeline did not stop in time: the response.done says failed
            log.warning("peer %s: cancel failed: %s", self.session_id, exc)
            self.send(
                protocol.error(
                    ProtocolError(type(exc).__name__, str(exc), type="server_error", event_id=event_id)
                )
            )

    # -- speech input -----------------------------------------------------------------------------------

    def _set_turn_detection(self, detection: TurnDetection | None) -> None:
        if detection == self.turn_detection:
            return
        # A new detector and an empty buffer: a turn half-heard under the old settings is dropped.
        self.turn_detection = detection
        self.input = InputAudioBuffer(detection, self.settings.max_turn_ms)
        self._input_item_id = None
        self._input_full_reported = False

    def _on_audio_append(self, event: protocol.InputAudioBufferAppend) -> None:
        self.input_audio_frames += 1
        ms = len(event.audio) * 3 / 4 / 2 * 1000 / protocol.INPUT_SAMPLE_RATE  # before decoding it
        if not self._input_rate.take(ms):
            raise ProtocolError(
                "rate_limited",
                "input audio is coming faster than 4x real time (after a 30 s burst): it is dropped",
                param="audio",
                event_id=event.event_id,
            )
        try:
            self._on_input_events(self.input.push(event.pcm(), protocol.INPUT_SAMPLE_RATE))
        except ProtocolError as exc:
            exc.event_id = event.event_id
            raise

    def _on_mic_frame(self, frame: Any) -> None:
        """One decoded WebRTC frame (48 kHz stereo s16 from aiortc) into the input buffer."""
        if self._input_failed or not self._input_rate.take(1000 * frame.samples / frame.sample_rate):
            return  # a client sending RTP faster than real time: the excess is not heard
        try:
            samples = frame.to_ndarray()  # packed: [1, samples * channels]; planar: [channels, samples]
            channels = len(frame.layout.channels)
            if frame.format.is_planar:
                samples, channels = samples.mean(axis=0), 1
            self._on_input_events(self.input.push(samples, frame.sample_rate, channels))
        except ProtocolError as exc:  # the buffer without VAD is full: say so once, until it is emptied
            if not self._input_full_reported:
                self._input_full_reported = True
                self.send(protocol.error(exc))
        except Exception:
            # A bug in speech input costs this client its speech input, never the track reading.
            log.exception("peer %s: speech input failed", self.session_id)
            self._input_failed = True
            self.send(
                protocol.error(ProtocolError("server_error", "speech input failed", type="server_error"))
            )

    def _on_input_events(self, events: list[SpeechStarted | SpeechStopped | Turn]) -> None:
        detection = self.turn_detection
        for ev in events:
            if isinstance(ev, SpeechStarted):
                self._input_item_id = protocol.new_id("item")
                self.send(
                    InputAudioBufferSpeechStarted(
                        audio_start_ms=ev.audio_start_ms, item_id=self._input_item_id
                    ).to_wire()
                )
                if detection is not None and detection.interrupt_response:
                    self._interrupt()
            elif isinstance(ev, SpeechStopped):
                item_id = self._input_item_id or protocol.new_id("item")
                self._input_item_id = item_id
                self.send(
                    InputAudioBufferSpeechStopped(audio_end_ms=ev.audio_end_ms, item_id=item_id).to_wire()
                )
            else:
                self._spoken_turn = SpokenTurnClock.from_turn(ev, self.input.arrivals)
                try:
                    self._commit_turn(ev)
                except ProtocolError as exc:  # too much speech already waits (create_response off)
                    self.send(protocol.error(exc))
                    continue
                if detection is not None and detection.create_response:
                    if self._response is None and self.session is not None:
                        self._start_response(self._max_tokens(), list(self.output_modalities))
                    else:  # still stopping (or not interrupted), or a new voice: answer when ready
                        self._respond_when_idle = True
        answer = self.input.pending  # semantic_vad asked its model: the turn may end when it answers
        if answer is not None and answer is not self._watched_answer:
            self._watched_answer = answer
            when_answered(answer, asyncio.get_running_loop(), self._on_turn_answer)

    def _on_turn_answer(self) -> None:
        if self._closing or self._input_failed:
            return
        try:
            self._on_input_events(self.input.poll())
        except Exception:  # as for a microphone frame: this client loses speech input, nothing else
            log.exception("peer %s: speech input failed", self.session_id)
            self._input_failed = True

    def _on_audio_commit(self, event: protocol.InputAudioBufferCommit) -> None:
        try:
            # A manual commit adds the turn; response.create answers it.
            self._commit_turn(self.input.commit())
            self._spoken_turn = None  # the latest speech has no detected end: no figure from it
        except ProtocolError as exc:
            exc.event_id = event.event_id
            raise

    def _commit_turn(self, turn: Turn) -> None:
        """The turn's audio becomes a user item, waiting for the next response like user text."""
        pending = sum(map(len, self._pending_audio)) + len(turn.audio)
        if pending > self.settings.max_pending_audio_ms * SPEECH_RATE // 1000:
            self._input_item_id = None
            raise ProtocolError(
                "pending_input_full",
                f"at most {self.settings.max_pending_audio_ms / 1000:g} s of speech wait for a response: "
                "send response.create; this turn is dropped",
            )
        item_id = self._input_item_id or protocol.new_id("item")
        self._input_item_id = None
        self._input_full_reported = False
        previous = self._last_item_id
        self.send(InputAudioBufferCommitted(item_id=item_id, previous_item_id=previous).to_wire())
        item = protocol.input_audio_item(item_id)
        self.send(protocol.conversation_item_added(item, previous))
        self.send(protocol.conversation_item_done(item, previous))
        self._last_item_id = item_id
        self._pending_audio.append(turn.audio)
        self.transcriber.add(item_id, turn.audio)

    def _max_tokens(self, asked: int | str | None = None) -> int:
        """A response's token limit: what it asks for, else the session's, never over the server's."""
        asked, limit = asked or self.max_output_tokens, self.settings.max_output_tokens
        return limit if asked == "inf" else max(1, min(int(asked), limit))

    def _on_item_truncate(self, event: protocol.ConversationItemTruncate) -> None:
        """Record how much of a reply the client played. The session keeps the whole reply in its
        conversation (the model's context is not rewritten); the client's transcript is its own."""
        response = self._items.get(event.item_id)
        if response is None:
            raise ProtocolError(
                "invalid_value", f"no assistant item {event.item_id!r} with audio", param="item_id",
                event_id=event.event_id,
            )  # fmt: skip
        if event.content_index != 0:
            raise ProtocolError(
                "invalid_value", "an assistant item has one content part (index 0)", param="content_index",
                event_id=event.event_id,
            )  # fmt: skip
        if event.audio_end_ms > response.audio_ms + 1:  # + 1: the client's rounding
            raise ProtocolError(
                "invalid_value",
                f"audio_end_ms {event.audio_end_ms} is past the item's audio ({response.audio_ms:.0f} ms)",
                param="audio_end_ms",
                event_id=event.event_id,
            )
        response.played_ms = float(event.audio_end_ms)
        self.send(
            protocol.conversation_item_truncated(event.item_id, event.content_index, event.audio_end_ms)
        )

    # -- responses --------------------------------------------------------------------------------------

    async def _run_response(
        self,
        response: _Response,
        text: str | None,
        audio: np.ndarray | None,
        max_tokens: int,
        modalities: list[str],
    ) -> None:
        audio_out = "audio" in modalities
        use_track = self.track is not None
        done_sent = False
        try:
            limits = {"max_output_tokens": max_tokens, "max_audio_frames": self.settings.max_audio_frames}
            if audio is not None:
                limits |= {"audio": audio, "audio_sample_rate": SPEECH_RATE}
            replies = self.session.respond(text, **limits)
            stopped = False
            async for ev in replies:
                kind = ev.type
                if response.cancelled and not stopped and kind not in ("response.created", "response.done"):
                    # Cut before the session had this response in hand (a barge-in while it was
                    # starting): its cancel found nothing to stop, so stop it now.
                    stopped = True
                    self._spawn(self._cancel_session(self.session), "cancel")
                if kind == "response.created":
                    response.id = ev.response_id
                    self.responses += 1
                    self.send(protocol.response_created(response.id))
                elif response.id is None:
                    continue  # nothing precedes response.created in a well-formed stream
                elif kind == "response.output_text.delta":
                    response.text.append(ev.delta)
                    if "text" in modalities and ev.delta:  # a token may end mid-character: no text yet
                        self.send(protocol.text_delta(response.id, response.item_id, ev.delta))
                elif kind == "response.output_audio_transcript.delta":
                    response.transcript.append(ev.delta)
                    if audio_out and ev.delta:
                        self.send(protocol.transcript_delta(response.id, response.item_id, ev.delta))
                elif kind == "response.output_audio.delta":
                    if not audio_out or response.cancelled:
                        continue
                    response.audio_ms += 1000.0 * len(ev.pcm) / ev.sample_rate
                    if response.spoken is not None:
                        response.spoken.audio_out(time.monotonic())
                    self.transcriber.release()
                    if use_track:
                        await self._audio.put((response, ev.pcm, ev.sample_rate))
                    else:  # in deltas of at most 500 ms: a long chunk would not fit a data channel message
                        step = ev.sample_rate // 2
                        for start in range(0, len(ev.pcm), step):
                            pcm = ev.pcm[start : start + step]
                            self.send(protocol.audio_delta(response.id, response.item_id, pcm))
                elif kind == "response.output_audio.done":
                    if audio_out and not response.cancelled:
                        if use_track:
                            await self._audio.put((response, _END, 0))
                        self.send(protocol.audio_done(response.id, response.item_id))
                elif kind == "error":
                    self.send(protocol.error(_session_error(ev)))
                elif kind == "response.done":
                    self._finish_texts(response, modalities)
                    self.send(protocol.response_done(self._response_object(response, ev)))
                    done_sent = True
        except asyncio.CancelledError:
            raise
        except OmniRtError as exc:
            self.send(protocol.error(ProtocolError(type(exc).__name__, str(exc), type="server_error")))
        except Exception:
            log.exception("peer %s: response failed", self.session_id)
            self.send(
                protocol.error(ProtocolError("server_error", "the response failed", type="server_error"))
            )
        finally:
            self.transcriber.release()
            if not done_sent and response.id is not None and not self._closing:
                # The Session promises response.done; if the stream broke anyway, the client still gets one.
                status = "cancelled" if response.cancelled else "failed"
                self.send(protocol.response_done(protocol.response_object(response.id, status)))
            if self._response is response:
                self._response = None
                if self._respond_when_idle and not self._closing:
                    self._start_response(self._max_tokens(), list(self.output_modalities))

    def _finish_texts(self, response: _Response, modalities: list[str]) -> None:
        if "audio" in modalities and response.transcript:
            self.send(protocol.transcript_done(response.id, response.item_id, "".join(response.transcript)))
        if "text" in modalities:
            self.send(protocol.text_done(response.id, response.item_id, "".join(response.text)))

    def _response_object(self, response: _Response, done: Any) -> dict[str, Any]:
        transcript = "".join(response.transcript or response.text)
        item = protocol.item_object(response.item_id, "assistant", transcript, status=done.status)
        details = None
        if getattr(done, "error", None) is not None:
            details = {"type": done.status, "error": done.error.model_dump()}
        elif done.status == "cancelled":
            details = {"type": "cancelled", "reason": "client_cancelled"}
        usage = done.usage.model_dump() if getattr(done, "usage", None) is not None else None
        return protocol.response_object(
            response.id,
            done.status,
            [item],
            status_details=details,
            usage=usage,
            metrics=protocol.metrics_dict(getattr(done, "metrics", None))
            | (response.spoken.metrics() if response.spoken is not None else {}),
        )

    async def _cancel_response(self, response: _Response, event_id: str | None = None) -> None:
        """Barge-in: stop the model, drop every sample not yet sent, keep the session."""
        if self._cut(response) and self.session is not None:
            await self._cancel_session(self.session, event_id)

    def _cut(self, response: _Response) -> bool:
        """Silence a response now: no more of its audio goes out. False if it was already cut."""
        if response.cancelled:
            return False
        response.cancelled = True
        self._record_played(response)
        self._drop_queued_audio()
        if response.id is not None and self.track is not None:
            self.send(protocol.output_audio_buffer("cleared", response.id))
        return True

    def _drop_queued_audio(self) -> None:
        while not self._audio.empty():
            self._audio.get_nowait()
        if self.track is not None:
            self.track.clear()

    async def _stop_response(self) -> None:
        """On close: cancel the response in progress (which frees its GPU work) and wait for it."""
        response = self._response
        if response is None:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._cancel_response(response), 5.0)
        if response.task is not None:
            try:
                # Let it see its response.done (the session's promise); then stop it regardless.
                await asyncio.wait_for(asyncio.shield(response.task), 2.0)
            except TimeoutError:
                response.task.cancel()
                await asyncio.gather(response.task, return_exceptions=True)
            except Exception:
                pass

    # -- WebRTC -----------------------------------------------------------------------------------------

    async def _on_offer(self, event: protocol.WebRtcOffer) -> None:
        if self.pc is not None:
            raise ProtocolError(
                "renegotiation_unsupported", "this connection already has WebRTC", event_id=event.event_id
            )
        pc = self.pc = webrtc.peer_connection(self.settings.ice_servers)  # set first: close() closes it
        pc.on("datachannel", self._on_datachannel)
        pc.on("track", self._on_remote_track)

        @pc.on("connectionstatechange")
        def _state() -> None:
            if pc.connectionState in ("failed", "closed") and not self._closing:
                log.info("peer %s: WebRTC %s", self.session_id, pc.connectionState)
                self._shutdown()

        track = AudioOutputTrack(
            idle=self.settings.idle, on_started=self._on_audio_started, on_stopped=self._on_audio_stopped
        )
        try:
            answer, sends = await webrtc.answer_offer(pc, event.sdp, track)
        except ValueError as exc:
            track.stop()
            raise ProtocolError(
                "invalid_sdp", str(exc), param="sdp", event_id=event.event_id, fatal=True
            ) from None
        if sends:
            self.track = track
            self._spawn(self._feed_track(track), "track feeder")
        else:
            # No audio, or send-only audio (a microphone, nothing to play): nobody would read the
            # track, so the reply's audio goes as events instead of piling up in front of it.
            track.stop()
        # Signaling always goes on the socket: the data channel does not exist until this answer lands.
        self._send_socket(json.dumps(protocol.webrtc_answer(answer)))

    def _on_datachannel(self, channel: Any) -> None:
        if channel.label != "events" or self.channel is not None:
            channel.close()
            return
        self.channel = channel
        channel.on("message", self._on_channel_message)

    def _on_remote_track(self, track: Any) -> None:
        self._spawn(self._consume_remote_media(track), "microphone" if track.kind == "audio" else "video")

    async def _consume_remote_media(self, track: Any) -> None:
        """Always read the client's media: aiortc queues unread frames without bound (video is
        declined, so none should come). Audio goes to the input buffer (server VAD, turns); nothing
        in this loop waits but `recv()`."""
        try:
            while True:
                frame = await track.recv()
                if track.kind == "audio":
                    self.input_audio_frames += 1
                    self._on_mic_frame(frame)
        except MediaStreamError:
            pass

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
        self.send(protocol.output_audio_buffer("started", response_id))

    def _on_audio_stopped(self, response_id: str) -> None:
        self.send(protocol.output_audio_buffer("stopped", response_id))


def _session_error(ev: Any) -> ProtocolError:
    info = ev.error
    return ProtocolError(info.code or "error", info.message, type=info.type)
