"""The smallest embedding: stream one spoken reply into a WAV file, printing text as it arrives.

    python examples/say.py "Tell me about the sea." reply.wav

Any `Engine.load` target works: "tiny" (CPU, random weights, no downloads), a checkpoint directory, or
`Engine.load("qwen3-omni-30b-a3b", random_weights=True, device="cuda")` for the real shapes.
"""

import asyncio
import sys
import wave

import omni_rt


async def say(text: str, path: str) -> omni_rt.ResponseDone:
    engine = omni_rt.Engine.load("tiny")
    async with engine, engine.session(voice="chelsie", output_sample_rate=24000) as session:
        with wave.open(path, "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(24000)
            async for ev in session.respond(text, max_output_tokens=32, max_audio_frames=48):
                if ev.type == "response.output_text.delta":
                    print(ev.delta, end="", flush=True)
                elif ev.type == "response.output_audio.delta":
                    wav.writeframes(ev.pcm.tobytes())  # int16, written as it is made
                elif ev.type == "response.done":
                    m = ev.metrics
                    print(
                        f"\n{ev.status}: first audio after {m.ttfa_ms:.0f} ms, {m.audio_seconds:.2f} s of audio"
                    )
                    return ev
    raise RuntimeError("the response ended without response.done")


if __name__ == "__main__":
    asyncio.run(
        say(sys.argv[1] if len(sys.argv) > 1 else "Hello!", sys.argv[2] if len(sys.argv) > 2 else "reply.wav")
    )
