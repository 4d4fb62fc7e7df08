"""livekit-agents' OpenAI realtime plugin, unmodified, against the server, with no LiveKit server: the
model's session alone. Audio is received for a reply (it keys every delta by the item that
`response.output_item.added` announced), an interrupt cuts a reply, and a reply after it plays. Its
defaults (voice `marin`, `semantic_vad`) are accepted; `generate_reply()` resolves only when
`response.created` echoes the request's metadata."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

pytest.importorskip("livekit.plugins.openai")

import aiohttp  # noqa: E402
from livekit.agents import Agent, AgentSession, RunContext, function_tool  # noqa: E402
from livekit.plugins.openai import realtime  # noqa: E402
from server_fakes import FRAME, FakeEngine  # noqa: E402
from test_server_tools import call_script  # noqa: E402  (the Thinker's deltas of one call)

from omni_rt.integrations.livekit_io import PlayoutAudioOutput, QueueAudioInput  # noqa: E402
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
    assert set(engine.voices) == {"chelsie"}  # every reply in livekit's default voice, marin, by the table


async def test_agent_session_calls_a_function_tool_and_speaks_its_result(caplog):
    """An `AgentSession` on livekit's OpenAI plugin with a `@function_tool`: the user's text reaches the
    model, the model's `<tool_call>` runs the tool, its result goes back and the reply to it is spoken; the
    framework logs no error."""
    calls: list[str] = []

    class Forecaster(Agent):
        def __init__(self) -> None:
            super().__init__(instructions="Help.")

        @function_tool
        async def get_weather(self, ctx: RunContext, city: str) -> str:
            """The weather in a city."""
            calls.append(city)
            engine.script, engine.reply = None, "It is sunny."  # the model's answer to the result
            return "sunny"

    caplog.set_level(logging.WARNING, logger="livekit.agents")
    engine = FakeEngine(step_s=0.02)
    body = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    engine.script = call_script(body)
    heard: list = []
    answered = asyncio.Event()
    async with Server(engine, ServerSettings(port=0, token="tk")) as server, aiohttp.ClientSession() as http:
        model = realtime.RealtimeModel(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="tk", http_session=http
        )
        session = AgentSession(llm=model)
        session.input.audio = QueueAudioInput()
        session.output.audio = PlayoutAudioOutput(on_frame=lambda f: (heard.append(f), answered.set()))
        await session.start(Forecaster(), record=False)
        try:
            await session.generate_reply(user_input="Weather in Paris?")
            with contextlib.suppress(TimeoutError):  # checked below, after what leads to it
                await asyncio.wait_for(answered.wait(), 10)  # the reply after the tool's result
        finally:
            await session.aclose()
    assert "Weather in Paris?" in str(engine.requests[0])
    assert calls == ["Paris"]
    assert engine.requests[-1] == "<tool_response>\nsunny\n</tool_response>"
    assert answered.is_set()
    assert [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "pause" not in r.getMessage()
    ] == []
