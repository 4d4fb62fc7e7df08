"""Helpers for the server tests: a scripted engine and an aiortc client.

`FakeEngine` stands in for `omni_rt.Engine` with the public Session API.

It yields the SDK's own event classes in the order a Session does (created, text and transcript deltas,
80 ms sine chunks at 24 kHz, audio done, response.done with metrics), paced by a per-word delay, and
keeps count of open sessions, running responses and model steps so tests can prove that a vanished
client stops the work it started. `Client` is a realtime client as a browser is one: signaling on the
socket, events on the `events` data channel, the reply's audio on a track.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import itertools
import json
import time

import av
import numpy as np
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from omni_rt.errors import InvalidRequestError, SessionLimitError, StageError
from omni_rt.events import (
    ErrorEvent,
    Metrics,
    ResponseCreated,
    ResponseDone,
    ResponseOutputAudioDelta,
    ResponseOutputAudioDone,
    ResponseOutputAudioTranscriptDelta,
    ResponseOutputTextDelta,
    Usage,
)

RATE = 24000
FRAME = RATE * 80 // 1000  # one codec frame: 80 ms
VOICES = ("ethan", "chelsie")


class FakeSession:
    def __init__(self, engine: FakeEngine, voice: str, instructions: str | None, output_sample_rate: int):
        self.engine = engine
        self.voice = voice
        self.instructions = instructions
        self.rate = output_sample_rate
        self._cancel = asyncio.Event()
        self.pcm_samples: dict[str, int] = {}  # response id → samples yielded
        # as the Session's, in FakeTokenizer's readable "ids": (role, text) turns, grown by each response
        self.conversation: list[tuple[str, str]] = []

    def live_speech(self):
        return None  # the Session's encoding while speaking needs a model (tests/test_speculation.py)

    async def respond(
        self,
        text: str | None = None,
        *,
        audio: np.ndarray | None = None,
        audio_sample_rate: int = 16000,
        max_output_tokens: int = 256,
        input_ids: list | None = None,
        voice: str | None = None,
        instructions: str | None = None,
        **_: object,
    ):
        rid = f"resp_{next(self.engine.ids)}"
        self._cancel.clear()
        self.engine.requests.append(text if input_ids is None else input_ids)
        self.engine.voices.append(voice or self.voice)
        self.engine.turn_instructions.append(instructions)
        if self.engine.refuse:  # as the Session refuses a turn: error, response.done failed, not recorded
            exc = self.engine.refuse.pop(0)
            yield ResponseCreated(response_id=rid)
            yield ErrorEvent.from_exception(exc, rid)
            yield ResponseDone(response_id=rid, status="failed", error=ErrorEvent.from_exception(exc).error)
            return
        self.engine.running += 1
        if not self.conversation and self.instructions and input_ids is None:
            self.conversation.append(("system", self.instructions))  # as the Session's first turn
        if instructions is not None:
            self.conversation.append(("system", instructions))
        self.conversation += [*input_ids] if input_ids is not None else [("user", text or "(speech)")]
        if audio is not None:
            self.engine.audio_requests.append((audio, audio_sample_rate))
            text = f"{len(audio) / audio_sample_rate:.1f} seconds" if text is None else text
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ttft = ttfa = None
        status = "completed"
        try:
            yield ResponseCreated(response_id=rid)
            words = (self.engine.reply or f"you said {text}").split()[:max_output_tokens]
            # A scripted Thinker: (text, token ids) per delta, as the session streams them.
            script = self.engine.script or [(w if i == 0 else " " + w, [i]) for i, w in enumerate(words)]
            words = script[:max_output_tokens]
            phase = 0
            for i, (delta, token_ids) in enumerate(words):
                if self._cancel.is_set():
                    status = "cancelled"
                    break
                await asyncio.sleep(self.engine.step_s)
                if self.engine.fail_after is not None and i >= self.engine.fail_after:
                    raise StageError("talker: simulated failure")
                self.engine.steps += 1
                ttft = ttft if ttft is not None else 1000 * (loop.time() - t0)
                yield ResponseOutputTextDelta(response_id=rid, delta=delta, token_ids=token_ids)
                yield ResponseOutputAudioTranscriptDelta(response_id=rid, delta=delta)
                n = FRAME * self.engine.frames_per_word
                t = (phase + np.arange(n)) / RATE
                phase += n
                pcm = (6000 * np.sin(2 * np.pi * 330 * t)).astype(np.int16)
                ttfa = ttfa if ttfa is not None else 1000 * (loop.time() - t0)
                self.pcm_samples[rid] = self.pcm_samples.get(rid, 0) + n
                yield ResponseOutputAudioDelta(
                    response_id=rid,
                    pcm=pcm,
                    sample_rate=RATE,
                    frame_index=i,
                    num_frames=self.engine.frames_per_word,
                )
            if status == "completed":
                yield ResponseOutputAudioDone(response_id=rid)
            yield ResponseDone(
                response_id=rid,
                status=status,
                usage=Usage(output_tokens=len(words)),
                metrics=Metrics(ttft_ms=ttft, ttfa_ms=ttfa, total_ms=1000 * (loop.time() - t0)),
            )
        finally:
            self.engine.running -= 1

    async def cancel(self) -> None:
        self._cancel.set()


class FakeEngine:
    def __init__(
        self,
        *,
        step_s: float = 0.02,
        frames_per_word: int = 1,
        reply: str | None = None,
        max_sessions: int = 8,
        fail_after: int | None = None,
    ):
        self.fail_after = fail_after  # raise StageError after this many words, as a broken stage would
        self.refuse: list[Exception] = []  # the next responses' errors, refused as a Session does
        self.step_s = step_s
        self.frames_per_word = frames_per_word
        self.reply = reply
        self.max_sessions = max_sessions
        self.ids = itertools.count(1)
        self.open_sessions = 0
        self.running = 0  # responses whose generator is still alive
        self.steps = 0  # "model steps" taken, to see work stop
        self.requests: list[str | None] = []  # the text of each response (None: speech only)
        self.audio_requests: list[tuple[np.ndarray, int]] = []  # (speech, its rate) of spoken turns
        self.sessions: list[FakeSession] = []
        self.voices: list[str] = []  # the voice of each response
        self.script: list[tuple[str, list[int]]] | None = None  # replaces `reply`: the Thinker's deltas
        self.instructions: list[str | None] = []  # of each session opened
        self.turn_instructions: list[str | None] = []  # respond(instructions=...) of each response
        self.tokenizer = FakeTokenizer()

    def speaker_id(self, voice: str) -> int:
        if voice not in VOICES:
            raise InvalidRequestError(f"unknown voice {voice!r}; known: {', '.join(VOICES)}")
        return VOICES.index(voice)

    @contextlib.asynccontextmanager
    async def session(
        self, *, voice: str = "ethan", instructions: str | None = None, output_sample_rate: int = RATE
    ):
        if voice not in VOICES:
            raise InvalidRequestError(f"unknown voice {voice!r}; known: {', '.join(VOICES)}")
        if self.open_sessions >= self.max_sessions:
            raise SessionLimitError(f"all {self.max_sessions} session slots are in use")  # as the Engine
        self.open_sessions += 1
        self.instructions.append(instructions)
        s = FakeSession(self, voice, instructions, output_sample_rate)
        self.sessions.append(s)
        try:
            yield s
        finally:
            await s.cancel()
            self.open_sessions -= 1


class FakeTokenizer:
    """What the server uses: chat prompts, here as readable (role, text) pairs, and their last turns."""

    def chat_prompt(self, messages, add_generation_prompt: bool = True) -> list:
        return [*map(tuple, messages), *([("assistant", "")] if add_generation_prompt else [])]

    def last_turn(self, ids, role: str) -> str | None:
        return next((text for r, text in reversed(ids) if r == role), None)


def user_message(text: str) -> dict:
    """`conversation.item.create` of a user text message."""
    return {
        "type": "conversation.item.create",
        "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
    }


def speech_like(seconds: float, rate: int, *, seed: int = 0) -> np.ndarray:
    """A voice-like burst as float32: a gliding 120-180 Hz pitch with harmonics, syllables (4 Hz
    envelope) and a little breath noise; loud enough for the VAD (about -15 dBFS), not clipped."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    pitch = 150 + 30 * np.sin(2 * np.pi * 1.3 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    voiced = sum(np.sin(k * phase) / k for k in (1, 2, 3, 4))
    syllables = 0.55 + 0.45 * np.sin(2 * np.pi * 4 * t) ** 2
    edges = np.minimum(1.0, np.minimum(t, t[-1] - t) / 0.03)  # 30 ms fades: no clicks
    x = 0.25 * voiced * syllables * edges + 0.003 * rng.standard_normal(len(t))
    return x.astype(np.float32)


class MicTrack(MediaStreamTrack):
    """A microphone for aiortc clients: `play()` queues 48 kHz float audio; silence in between.

    Paced like a real device (20 ms frames on the monotonic clock), so the server hears real time.
    """

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._queue = np.zeros(0, np.float32)
        self._pts = 0
        self._start: float | None = None
        self.played = asyncio.Event()  # set when the queued audio has all gone out

    def play(self, audio: np.ndarray) -> None:
        self.played.clear()
        self._queue = np.concatenate([self._queue, audio.astype(np.float32)])

    async def recv(self):
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        wait = self._start + self._pts / 48000 - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        chunk, self._queue = self._queue[:960], self._queue[960:]
        if len(chunk) < 960:
            chunk = np.concatenate([chunk, np.zeros(960 - len(chunk), np.float32)])
            self.played.set()
        frame = av.AudioFrame.from_ndarray(
            (np.clip(chunk, -1, 1) * 32767).astype(np.int16).reshape(1, -1), format="s16", layout="mono"
        )
        frame.sample_rate, frame.time_base, frame.pts = 48000, fractions.Fraction(1, 48000), self._pts
        self._pts += 960
        return frame


@pytest.fixture(autouse=True)
def loopback_ice(monkeypatch):
    """Import into a test module: its aiortc clients gather on loopback alone, as the server does when
    bound to 127.0.0.1 (webrtc.IcePolicy); Client.connect asserts both sides' candidates, so no test
    media leaves loopback."""
    from omni_rt.server import webrtc

    monkeypatch.setattr(webrtc, "_gather_all", lambda use_ipv4, use_ipv6: ["127.0.0.1"] if use_ipv4 else [])


def candidate_addresses(sdp: str) -> list[str]:
    """The address of every ICE candidate in an SDP."""
    return [line.split(" ")[4] for line in sdp.splitlines() if line.startswith("a=candidate:")]


class Client:
    """A realtime client as a browser would be: signaling on the socket, events on a data channel."""

    def __init__(self, ws, mic: MicTrack | None = None):
        self.ws = ws
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.events: asyncio.Queue = asyncio.Queue()
        self.frames: list[tuple[float, object]] = []
        self._tasks: list[asyncio.Task] = []
        self.direction = "recvonly"  # of the offer's audio
        self.mic = mic  # sent up the audio transceiver (then sendrecv)

    async def connect(self) -> dict:
        created = json.loads(await self.ws.recv())
        if self.mic is not None:
            self.pc.addTransceiver(self.mic, direction="sendrecv")
        elif self.direction == "sendonly":
            from aiortc.mediastreams import AudioStreamTrack

            self.pc.addTransceiver(AudioStreamTrack(), direction="sendonly")  # a "microphone" of silence
        else:
            self.pc.addTransceiver("audio", direction=self.direction)
        self.channel = self.pc.createDataChannel("events")
        opened = asyncio.Event()
        self.channel.on("open", opened.set)
        self.channel.on("message", lambda m: self.events.put_nowait(json.loads(m)))
        self.pc.on("track", lambda track: self._tasks.append(asyncio.create_task(self._read(track))))
        await self.pc.setLocalDescription(await self.pc.createOffer())
        await self.ws.send(json.dumps({"type": "webrtc.offer", "sdp": self.pc.localDescription.sdp}))
        answer = json.loads(await asyncio.wait_for(self.ws.recv(), 10))
        assert answer["type"] == "webrtc.answer", answer
        # Media on loopback alone (issue #13, defect 7): every candidate of the offer and the answer.
        candidates = candidate_addresses(self.pc.localDescription.sdp) + candidate_addresses(answer["sdp"])
        assert candidates and set(candidates) == {"127.0.0.1"}, candidates
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
        await asyncio.wait_for(opened.wait(), 10)
        return created

    async def _read(self, track):
        try:
            while True:
                frame = await track.recv()
                self.frames.append((time.monotonic(), frame))
        except MediaStreamError:
            pass

    def send(self, event: dict) -> None:
        self.channel.send(json.dumps(event))

    def say(self, text: str) -> None:
        self.send(user_message(text))
        self.send({"type": "response.create"})

    async def until(self, *types: str, timeout: float = 15) -> list[dict]:
        """Events up to and including the first of each of `types` (in any order)."""
        seen, wanted = [], set(types)
        async with asyncio.timeout(timeout):
            while wanted:
                ev = await self.events.get()
                seen.append(ev)
                wanted.discard(ev["type"])
        return seen

    async def close(self):
        if self.mic is not None:
            self.mic.stop()
        await self.pc.close()
        for t in self._tasks:
            t.cancel()


class RecordingEngine:
    """Wraps a real `omni_rt.Engine`: the server sees the same API; the test sees the PCM it was given.
    `sampling` (e.g. `Sampling(seed=0)`): every session's, so that a test of exact lengths does not
    depend on a fresh seed (random weights end a reply early for some seeds)."""

    def __init__(self, engine, sampling=None):
        self.engine = engine
        self.sampling = sampling
        self.pcm_samples: dict[str, int] = {}  # response id → samples of PCM the session yielded
        self.sample_rate: int | None = None

    def session(self, **kwargs):
        if self.sampling is not None:
            kwargs["sampling"] = self.sampling
        return _RecordingSession(self, self.engine.session(**kwargs))

    def __getattr__(self, name):
        return getattr(self.engine, name)  # the rest of the Engine's API (its tokenizer, ...), as it is


class _RecordingSession:
    def __init__(self, owner: RecordingEngine, inner):
        self.owner = owner
        self.inner = inner

    async def __aenter__(self):
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc):
        await self.inner.__aexit__(*exc)

    async def respond(self, *args, **kwargs):
        async for ev in self.inner.respond(*args, **kwargs):
            if ev.type == "response.output_audio.delta":
                self.owner.pcm_samples[ev.response_id] = (
                    self.owner.pcm_samples.get(ev.response_id, 0) + ev.pcm.size
                )
                self.owner.sample_rate = ev.sample_rate
            yield ev

    async def cancel(self):
        await self.inner.cancel()

    def __getattr__(self, name):
        return getattr(self.inner, name)  # the rest of the Session's API, as it is
