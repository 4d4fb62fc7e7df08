"""A voice agent loop without a browser: microphone frames in, spoken replies out, barge-in included.

    python examples/voice_agent.py

The shape voice-agent frameworks expect (fastrtc's `receive`/`emit`, livekit's `push_audio`/`interrupt`,
pipecat's input audio and interruption frames): push 16 kHz mic audio as it arrives; server-side VAD
(Silero VAD with OpenAI Realtime semantics: 300 ms prefix, 500 ms of silence ends a turn) cuts turns; each turn is
answered with `Session.respond(audio=...)`; speech that starts while a reply plays cancels the reply.
Here the "microphone" is synthetic: two short voiced bursts, the second one interrupting the first reply.
"""

import asyncio

import numpy as np

import omni_rt
from omni_rt.audio.vad import SpeechStarted, Turn, TurnSegmenter

RATE = 16000
FRAME = RATE // 50  # 20 ms of mic audio per push, as a WebRTC or sound-card callback delivers it


class VoiceAgent:
    def __init__(self, session: omni_rt.Session) -> None:
        self.session = session
        self.vad = TurnSegmenter()
        self.speaker: asyncio.Queue[np.ndarray] = asyncio.Queue(maxsize=64)  # PCM for your audio output
        self._reply: asyncio.Task | None = None

    async def push_audio(self, pcm: np.ndarray) -> None:
        for ev in self.vad.push(pcm):
            if isinstance(ev, SpeechStarted) and self._reply and not self._reply.done():
                await self.session.cancel()  # barge-in: generation stops within one codec frame
                while not self.speaker.empty():  # and what is queued for the speaker is dropped
                    self.speaker.get_nowait()
                    self.speaker.task_done()
                print(f"[barge-in at {ev.audio_start_ms} ms]")
            elif isinstance(ev, Turn):
                print(f"[turn {ev.audio_start_ms}-{ev.audio_end_ms} ms]")
                self._reply = asyncio.create_task(self._answer(ev.audio))

    async def _answer(self, audio: np.ndarray) -> None:
        async for ev in self.session.respond(audio=audio, audio_sample_rate=RATE, max_audio_frames=40):
            if ev.type == "response.output_audio.delta":
                await self.speaker.put(ev.pcm)
            elif ev.type == "response.done":
                print(f"[reply {ev.status}: {ev.metrics.audio_seconds:.2f} s of audio]")
        await self.speaker.join()  # the reply lasts until it has been heard (or interrupted)

    async def wait(self) -> None:
        if self._reply:
            await self._reply


async def play(speaker: asyncio.Queue[np.ndarray]) -> None:
    """Stands in for the sound card: consumes the reply's 24 kHz PCM in real time."""
    while True:
        pcm = await speaker.get()
        await asyncio.sleep(pcm.size / 24000)
        speaker.task_done()


def voiced(seconds: float, seed: int) -> np.ndarray:
    """A speech-like burst: a gliding 120-180 Hz pitch with harmonics, syllables and a little breath
    noise (the VAD is a trained model: a steady tone is not speech to it)."""
    t = np.arange(int(seconds * RATE)) / RATE
    phase = 2 * np.pi * np.cumsum(150 + 30 * np.sin(2 * np.pi * 1.3 * t)) / RATE
    tone = sum(np.sin(k * phase) / k for k in range(1, 5))
    envelope = (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t) ** 2) * np.minimum(
        1.0, np.minimum(t, t[-1] - t) / 0.03
    )
    noise = np.random.default_rng(seed).normal(0, 0.003, t.size)
    return (0.25 * tone * envelope + noise).astype(np.float32)


async def main() -> None:
    engine = omni_rt.Engine.load("tiny")
    async with engine, engine.session(voice="ethan") as session:
        agent = VoiceAgent(session)
        speaker = asyncio.create_task(play(agent.speaker))
        silence = np.zeros(int(0.7 * RATE), np.float32)
        # the user speaks, listens to the reply for a while, then talks over it
        mic = np.concatenate([silence, voiced(0.8, 0), silence, silence, voiced(0.6, 1), silence])
        # paced like a real microphone, by the clock: a push that took long does not slow the audio that
        # follows (the speaker plays in real time, so a mic that fell behind would talk over nothing)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for n, i in enumerate(range(0, mic.size, FRAME)):
            await agent.push_audio(mic[i : i + FRAME])
            await asyncio.sleep(max(0.0, start + (n + 1) * FRAME / RATE - loop.time()))
        await agent.wait()
        speaker.cancel()


if __name__ == "__main__":
    asyncio.run(main())
