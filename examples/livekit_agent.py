"""A LiveKit voice agent on omni_rt, in process: `AgentSession(llm=RealtimeModel(engine))`.

    espeak-ng -w hello.wav "Good morning to you"
    python examples/livekit_agent.py hello.wav [--until-first-audio]

omni_rt's VAD cuts the caller's turn and the agent answers it; the reply goes to reply.wav. Here the caller
is a WAV file played in real time into the session; in a LiveKit deployment, `session.start(agent,
room=ctx.room)` in your entrypoint replaces the two I/O lines, and nothing else changes.
"""

import asyncio
import sys
import wave

import numpy as np
from livekit import rtc
from livekit.agents import Agent, AgentSession

import omni_rt
from omni_rt.integrations.livekit import RealtimeModel
from omni_rt.integrations.livekit_io import PlayoutAudioOutput, QueueAudioInput


async def main(path: str, until_first_audio: bool) -> None:
    with wave.open(path) as w:  # mono int16 speech, any rate: the model resamples it once
        rate, pcm = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), np.int16)
    pcm = np.concatenate([pcm, np.zeros(rate, np.int16)])  # then a second of silence ends the turn
    reply: list[rtc.AudioFrame] = []
    heard = asyncio.Event()
    engine = omni_rt.Engine.load("tiny")
    async with engine:
        seeded = omni_rt.Sampling(seed=0)  # the same reply every run
        session = AgentSession(llm=RealtimeModel(engine, max_audio_frames=40, sampling=seeded))
        speaker = PlayoutAudioOutput(on_frame=lambda f: (reply.append(f), heard.set()))
        mic = QueueAudioInput()
        session.input.audio, session.output.audio = mic, speaker  # or session.start(..., room=ctx.room)
        await session.start(Agent(instructions="You are a friendly, brief assistant."), record=False)
        step = rate // 100  # 10 ms frames, paced like a microphone
        for i in range(0, len(pcm), step):
            mic.push(rtc.AudioFrame(pcm[i : i + step].tobytes(), rate, 1, len(pcm[i : i + step])))
            await asyncio.sleep(0.01)
        await asyncio.wait_for(heard.wait(), 120)
        print(f"first audio: {reply[0].samples_per_channel} samples at {reply[0].sample_rate} Hz")
        if not until_first_audio:
            if session.current_speech is not None:
                await session.current_speech.wait_for_playout()
            with wave.open("reply.wav", "wb") as out:
                out.setnchannels(1), out.setsampwidth(2), out.setframerate(reply[0].sample_rate)
                out.writeframes(b"".join(bytes(f.data) for f in reply))
            print(f"reply: {sum(f.duration for f in reply):.2f} s of audio in reply.wav")
        await session.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], "--until-first-audio" in sys.argv))
