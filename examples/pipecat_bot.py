"""A pipecat voice bot on omni_rt, in process: pipecat's VAD and turn analyzer cut turns, omni_rt answers.

    espeak-ng -w hello.wav "Good morning to you"
    python examples/pipecat_bot.py hello.wav [--until-first-audio]

The "microphone" is a WAV file fed in real time as `InputAudioRawFrame`s and the "speaker" writes the reply
to reply.wav; in a real bot `transport.input()` and `transport.output()` (Daily, WebRTC, Twilio, ...) take
their places in the pipeline, and nothing else changes.
"""

import asyncio
import sys
import wave

import numpy as np
from pipecat.audio.turn.smart_turn.local_smart_turn_v3 import LocalSmartTurnAnalyzerV3
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.frames.frames import InputAudioRawFrame, LLMFullResponseEndFrame, TTSAudioRawFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.turns.user_stop import TurnAnalyzerUserTurnStopStrategy
from pipecat.turns.user_turn_processor import UserTurnProcessor
from pipecat.turns.user_turn_strategies import UserTurnStrategies
from pipecat.workers.runner import WorkerRunner

import omni_rt
from omni_rt.audio.resample import resample
from omni_rt.integrations.pipecat import OmniRtService


class Speaker(FrameProcessor):
    """Stands in for transport.output(): keeps the reply's audio."""

    def __init__(self) -> None:
        super().__init__()
        self.pcm, self.rate, self.first, self.done = [], 24000, asyncio.Event(), asyncio.Event()

    async def process_frame(self, frame, direction) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.pcm.append(frame.audio)
            self.rate = frame.sample_rate
            self.first.set()
        elif isinstance(frame, LLMFullResponseEndFrame):
            self.done.set()
        await self.push_frame(frame, direction)


async def main(path: str, until_first_audio: bool) -> None:
    with wave.open(path) as w:  # mono int16 speech; the transport would deliver 16 kHz, as Silero wants
        pcm = resample(
            np.frombuffer(w.readframes(w.getnframes()), np.int16) / 32768.0, w.getframerate(), 16000
        )
    pcm = (np.concatenate([pcm, np.zeros(16000)]) * 32767).astype(np.int16)  # a second of silence after
    engine = omni_rt.Engine.load("tiny")
    turns = UserTurnStrategies(stop=[TurnAnalyzerUserTurnStopStrategy(
        turn_analyzer=LocalSmartTurnAnalyzerV3(), wait_for_transcript=False)])  # fmt: skip
    speaker = Speaker()
    pipeline = Pipeline([
        VADProcessor(vad_analyzer=SileroVADAnalyzer()), UserTurnProcessor(user_turn_strategies=turns),
        OmniRtService(engine, instructions="You are a friendly, brief assistant.", max_audio_frames=40,
                      sampling=omni_rt.Sampling(seed=0)),  # seeded: the same reply every run
        speaker,
    ])  # fmt: skip
    worker = PipelineWorker(
        pipeline, params=PipelineParams(enable_metrics=True), cancel_on_idle_timeout=False
    )

    async def microphone() -> None:
        for i in range(0, len(pcm), 320):  # 20 ms frames, paced in real time
            await worker.queue_frame(InputAudioRawFrame(pcm[i : i + 320].tobytes(), 16000, 1))
            await asyncio.sleep(0.02)
        await asyncio.wait_for((speaker.first if until_first_audio else speaker.done).wait(), 120)
        print(f"first audio: {len(speaker.pcm[0]) // 2} samples at {speaker.rate} Hz")
        await (worker.cancel() if until_first_audio else worker.stop_when_done())  # cancel: barge-in

    runner = WorkerRunner()
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), microphone())
    if not until_first_audio:
        with wave.open("reply.wav", "wb") as out:
            out.setnchannels(1), out.setsampwidth(2), out.setframerate(speaker.rate)
            out.writeframes(b"".join(speaker.pcm))
        print(f"reply: {sum(map(len, speaker.pcm)) / 2 / speaker.rate:.2f} s of audio in reply.wav")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], "--until-first-audio" in sys.argv))
