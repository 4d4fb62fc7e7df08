"""livekit-agents' OpenAI realtime plugin, unmodified, against the server, with no LiveKit server: the
model's session alone. Audio is received for a reply (it keys every delta by the item that
`response.output_item.added` announced), an interrupt cuts a reply, and a reply after it plays. Its
defaults (voice `marin`, `semantic_vad`) are accepted; `generate_reply()` resolves only when
`response.created` echoes the request's metadata."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("livekit.plugins.openai")

import aiohttp  # noqa: E402
from livekit.plugins.openai import realtime  # noqa: E402
from server_fakes import FRAME, FakeEngine  # noqa: E402

from omni_rt.server import Server, ServerSettings  # noqa: E402


async def audio_of(generation, limit: int | None = None) -> int:
    """Audio frames of a generation's messages (stops after `limit`, leaving the rest unread)."""
    frames = 0
    async for message in generation.message_stream:
        async for _ in message.audio_stream:
            frames += 1
            if limit is not None and frames >= limit:
                return frames
    return frames


async def test_livekit_reply_interrupt_and_a_reply_after():
    engine = FakeEngine(step_s=0.05, reply=" ".join(["word"] * 30))
    async with Server(engine, ServerSettings(port=0, token="tk")) as server, aiohttp.ClientSession() as http:
        model = realtime.RealtimeModel(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="tk", http_session=http
        )
        session = model.session()
        errors: list = []
        session.on("error", errors.append)
        try:
            first = await asyncio.wait_for(session.generate_reply(instructions="Greet the user."), 10)
            assert await asyncio.wait_for(audio_of(first, limit=3), 10) == 3
            session.interrupt()  # response.cancel: the reply stops, its streams end
            async with asyncio.timeout(10):
                while engine.running:
                    await asyncio.sleep(0.02)
            (cut,) = engine.sessions[-1].pcm_samples.values()
            assert cut < 30 * FRAME  # the reply was cut before its 30 words

            engine.reply = "fine thanks"
            after = await asyncio.wait_for(session.generate_reply(), 10)
            assert await asyncio.wait_for(audio_of(after), 10) == 2  # one frame a word
        finally:
            await session.aclose()
    assert errors == []
    assert engine.sessions[-1].voice == "chelsie"  # livekit's default voice, marin, by the table
