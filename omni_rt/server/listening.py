"""One connection's speech input: appended audio and microphone frames into the input audio buffer,
its VAD events out as wire events, its turns into the conversation.

Microphone frames and `input_audio_buffer.append` audio go to one `InputAudioBuffer` (`speech.py`:
16 kHz, server VAD), rate-limited together. All of it is synchronous on the event loop, so the
microphone loop never waits on anything but the next frame. What a turn does to replies is the
peer's: `on_speech_started` (barge-in) and `on_turn` (answer it), called only with server VAD's
`interrupt_response` / `create_response` on. While a turn is spoken its audio goes to the session's
encoder as it arrives, and a pause that may end it is offered for a speculative reply (`on_pause`),
taken back when the voice resumes (`on_resume`): `live_turn.py`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from omni_rt import wire
from omni_rt.audio.vad import SpeechStarted, SpeechStopped, Turn
from omni_rt.server import protocol
from omni_rt.server.conversation import Conversation
from omni_rt.server.live_turn import LiveTurn, model_audio
from omni_rt.server.protocol import ProtocolError
from omni_rt.server.speech import SPEECH_RATE, InputAudioBuffer, InputRate, TurnDetection
from omni_rt.server.turns import SpokenTurnClock, when_answered

log = logging.getLogger("omni_rt.server")

APPEND_SLICE = 2 * wire.INPUT_SAMPLE_RATE  # samples of a long append heard at once: 2 s (see append)


class SpeechInput:
    def __init__(
        self,
        name: str,
        detection: TurnDetection | None,
        *,
        max_turn_ms: int,
        max_pending_ms: int,
        send: Callable[[dict[str, Any]], None],
        conversation: Conversation,
        on_speech_started: Callable[[], None],
        on_turn: Callable[[], None],
        on_committed: Callable[[str, Any], None] = lambda item_id, audio: None,
        live_speech: Callable[[], Any] = lambda: None,
        on_pause: Callable[[Callable[[], Any]], None] = lambda clip: None,
        on_resume: Callable[[], None] = lambda: None,
    ) -> None:
        self.name = name
        self.max_turn_ms, self.max_pending_ms = max_turn_ms, max_pending_ms
        self._send, self._conversation = send, conversation
        self._on_speech_started, self._on_turn = on_speech_started, on_turn
        self._on_committed = on_committed  # (item id, 16 kHz audio) of every spoken item (transcription)
        # the session's LiveSpeech for a new turn (None: no encoding while speaking); a pause that may
        # end the turn, with a function that makes its clip; the voice going on after it
        self._live_speech, self._on_pause, self._on_resume = live_speech, on_pause, on_resume
        self._live: LiveTurn | None = None  # the open turn's encoding
        self.spoken_turn: SpokenTurnClock | None = None  # the last detected turn, for the next response
        self._watched_answer: Any = None  # semantic_vad's pending answer that _on_turn_answer awaits
        self.detection = detection
        self.buffer = InputAudioBuffer(detection, max_turn_ms)
        self._rate = InputRate()  # appends and microphone frames together
        self._item_id: str | None = None  # the user item the turn being spoken will become
        self._full_reported = False  # the microphone overran a buffer without VAD: said once
        self._failed = False  # speech input hit a bug: the microphone is read and dropped
        self.frames = 0  # audio the client sent: appends and microphone frames

    def set_detection(self, detection: TurnDetection | None) -> None:
        if detection == self.detection:
            return
        if self.detection is not None and self.buffer.segmenter.in_speech:
            self._end_open_turn()
        # A new detector and an empty buffer (audio without VAD that nobody committed is dropped)
        self.detection = detection
        self.buffer = InputAudioBuffer(detection, self.max_turn_ms)
        self._item_id = None
        self._full_reported = False
        self._drop_live()

    def _end_open_turn(self) -> None:
        """The turn being spoken when the detector changes ends there, as if the speaker had paused, and
        waits for the next response without one of its own: what the user said so far is kept (a client
        turning VAD off mid-turn, as LiveKit's turn detection does, commits the rest itself), and the
        client that was told `speech_started` gets the rest of the item's events."""
        self._drop_live()  # with any reply offered at a pause: this turn is not answered by itself
        turn = self.buffer.segmenter.commit()
        assert turn is not None  # a turn is open while in speech
        self._item_id = self._item_id or wire.new_id("item")
        self._send(wire.speech_stopped(turn.audio_end_ms, self._item_id))
        try:
            self._commit(turn, model_audio(turn))
        except ProtocolError as exc:  # too much speech already waits
            self._send(protocol.error(exc))

    async def append(self, event: protocol.InputAudioBufferAppend) -> None:
        self.frames += 1
        ms = len(event.audio) * 3 / 4 / 2 * 1000 / wire.INPUT_SAMPLE_RATE  # before decoding it
        if not self._rate.take(ms):
            raise ProtocolError(
                "rate_limited",
                "input audio is coming faster than 4x real time (after a 30 s burst): it is dropped",
                param="audio",
                event_id=event.event_id,
            )
        pcm = event.pcm()
        # The detector takes ~10 ms of CPU a second of audio: a long append is heard in slices, the
        # event loop free between them, so that other connections' audio is not held up. Without a
        # detector it goes in whole (a full buffer refuses all of it, not a part).
        step = APPEND_SLICE if self.detection is not None else max(len(pcm), 1)
        for start in range(0, len(pcm), step):
            if start:
                await asyncio.sleep(0)
            try:
                self._on_events(self.buffer.push(pcm[start : start + step], wire.INPUT_SAMPLE_RATE))
            except ProtocolError as exc:
                exc.event_id = event.event_id
                raise

    def mic_frame(self, frame: Any) -> None:
        """One decoded WebRTC frame (48 kHz stereo s16 from aiortc) into the input buffer."""
        self.frames += 1
        if self._failed or not self._rate.take(1000 * frame.samples / frame.sample_rate):
            return  # a client sending RTP faster than real time: the excess is not heard
        try:
            samples = frame.to_ndarray()  # packed: [1, samples * channels]; planar: [channels, samples]
            channels = len(frame.layout.channels)
            if frame.format.is_planar:
                samples, channels = samples.mean(axis=0), 1
            self._on_events(self.buffer.push(samples, frame.sample_rate, channels))
        except ProtocolError as exc:  # the buffer without VAD is full: say so once, until it is emptied
            if not self._full_reported:
                self._full_reported = True
                self._send(protocol.error(exc))
        except Exception:
            # A bug in speech input costs this client its speech input, never the track reading.
            log.exception("peer %s: speech input failed", self.name)
            self._failed = True
            self._send(
                protocol.error(ProtocolError("server_error", "speech input failed", type="server_error"))
            )

    def commit(self, event: protocol.InputAudioBufferCommit) -> None:
        try:
            # A manual commit adds the turn; response.create answers it.
            turn = self.buffer.commit()
            self._commit(turn, turn.audio)
            self.spoken_turn = None  # the latest speech has no detected end: no figure from it
        except ProtocolError as exc:
            exc.event_id = event.event_id
            raise

    def clear(self) -> None:
        self.buffer.clear()
        self._item_id = None
        self._drop_live()
        self._send(wire.cleared())

    def _on_events(self, events: list[SpeechStarted | SpeechStopped | Turn]) -> None:
        detection = self.detection
        for ev in events:
            if isinstance(ev, SpeechStarted):
                self._item_id = wire.new_id("item")
                self._send(wire.speech_started(ev.audio_start_ms, self._item_id))
                self._open_live(ev.audio_start_ms)
                if detection is not None and detection.interrupt_response:
                    self._on_speech_started()
            elif isinstance(ev, SpeechStopped):
                self._item_id = self._item_id or wire.new_id("item")
                self._send(wire.speech_stopped(ev.audio_end_ms, self._item_id))
            else:
                self.spoken_turn = SpokenTurnClock.from_turn(ev, self.buffer.arrivals)
                try:
                    self._commit(ev, model_audio(ev))
                except ProtocolError as exc:  # too much speech already waits (create_response off)
                    self._send(protocol.error(exc))
                    continue
                if detection is not None and detection.create_response:
                    self._on_turn()
        if self._live is not None and self.buffer.segmenter.in_speech:
            self._follow_live()
        answer = self.buffer.pending  # semantic_vad asked its model: the turn may end when it answers
        if answer is not None and answer is not self._watched_answer:
            self._watched_answer = answer
            when_answered(answer, asyncio.get_running_loop(), self._on_turn_answer)

    def _on_turn_answer(self) -> None:
        if self._failed:
            return
        try:
            self._on_events(self.buffer.poll())
        except Exception:  # as for a microphone frame: this client loses speech input, nothing else
            log.exception("peer %s: speech input failed", self.name)
            self._failed = True

    # -- the turn being spoken ----------------------------------------------------------------------------

    def _open_live(self, start_ms: int) -> None:
        self._drop_live()
        live = self._live_speech()
        self._live = None if live is None else LiveTurn(live, start_ms)

    def _follow_live(self) -> None:
        assert self._live is not None
        try:
            resumed, pause = self._live.follow(self.buffer.segmenter)
        except Exception:  # the turn is then encoded whole at its end: nothing is lost
            log.exception("peer %s: encoding while speaking failed", self.name)
            self._drop_live()
            return
        if resumed:
            self._on_resume()
        if pause:
            self._on_pause(self._live.pause_clip)

    def _drop_live(self) -> None:
        """The open turn is gone (cleared, committed, a new detector): so is any reply offered at its pause."""
        if self._live is not None:
            self._live = None
            self._on_resume()

    def _finish_live(self, audio: Any) -> Any:
        live, self._live = self._live, None
        if live is None:
            return None
        try:
            return live.finish(audio)
        except Exception:
            log.exception("peer %s: encoding while speaking failed", self.name)
            return None

    def _commit(self, turn: Turn, audio: Any) -> None:
        """The turn's audio (what the model hears of it) becomes a user item, waiting for the next
        response like user text."""
        clip = self._finish_live(audio)
        pending = self._conversation.speech_samples + len(audio)
        if pending > self.max_pending_ms * SPEECH_RATE // 1000:
            self._item_id = None
            raise ProtocolError(
                "pending_input_full",
                f"at most {self.max_pending_ms / 1000:g} s of speech wait for a response: "
                "send response.create; this turn is dropped",
            )
        item_id = self._item_id or wire.new_id("item")
        self._item_id = None
        self._full_reported = False
        self._send(wire.committed(item_id, self._conversation.last_item_id))
        self._conversation.add_speech(item_id, audio, clip)
        self._on_committed(item_id, audio)
