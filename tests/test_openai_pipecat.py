"""pipecat's OpenAI Realtime service, unmodified, against the server: a text turn, a spoken turn that
barges in on a reply (server VAD), and a spoken turn after it. pipecat validates the server's events
strictly: a status outside OpenAI's schema, or an unknown voice, once ended its session. Each step waits
for the frames the one before it brings (`pipecat_support.run_pipeline`), not for a sleep."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("pipecat")

from pipecat.adapters.llm.schemas.function_schema import FunctionSchema  # noqa: E402
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema  # noqa: E402
from pipecat.frames.frames import (  # noqa: E402
    ErrorFrame,
    InputAudioRawFrame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    TTSAudioRawFrame,
)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.processors.aggregators.llm_context import LLMContext  # noqa: E402
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair  # noqa: E402
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService  # noqa: E402
from pipecat_support import Await, Count, run_pipeline  # noqa: E402
from server_fakes import FRAME, FakeEngine, speech_like  # noqa: E402
from test_server_tools import call_script  # noqa: E402  (the Thinker's deltas of one call)

from omni_rt.server import Server, ServerSettings  # noqa: E402


def speech_frames(seconds: float, rate: int = 24000) -> list[InputAudioRawFrame]:
    """A spoken turn then silence, in 20 ms frames, as a transport hands them to the service."""
    audio = np.concatenate([speech_like(seconds, rate), np.zeros(rate)])
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    step = rate // 50 * 2
    return [
        InputAudioRawFrame(audio=pcm[i : i + step], sample_rate=rate, num_channels=1)
        for i in range(0, len(pcm), step)
    ]


async def test_pipecat_text_turn_barge_in_and_a_turn_after():
    # A long reply (about 2 s) for the spoken turn to cut.
    engine = FakeEngine(step_s=0.05, reply=" ".join(["word"] * 40))
    async with Server(engine, ServerSettings(port=0, token="tk")) as server:
        llm = OpenAIRealtimeLLMService(api_key="tk", base_url=f"ws://127.0.0.1:{server.port}/v1/realtime")
        context = LLMContext(messages=[{"role": "user", "content": "Tell me a story."}])
        count = Count()
        ended = LLMFullResponseEndFrame  # one per response.done, the cancelled reply's too
        frames = [
            LLMContextFrame(context),
            Await(count.nth(TTSAudioRawFrame, 1), "the story's first audio"),  # the reply is under way
            *speech_frames(1.0),  # server VAD: speech starts, the reply is cut (turn_detected)
            Await(count.nth(ended, 2), "the reply to the speech that cut the story"),
            *speech_frames(0.8),  # a turn after the barge-in, once that reply is done
            Await(count.nth(ended, 3), "the reply to the turn after it"),
        ]
        down, up = await run_pipeline(Pipeline([llm, count]), frames)
    errors = [f for f in [*down, *up] if isinstance(f, ErrorFrame)]
    assert errors == []
    assert sum(isinstance(f, TTSAudioRawFrame) for f in down) > 0
    # The three turns reached the model: the text, the speech that cut its reply, the speech after.
    assert engine.requests == ["Tell me a story.", None, None] and len(engine.audio_requests) == 2
    first = engine.sessions[0].pcm_samples  # by response id, in order
    assert list(first.values())[0] < 40 * FRAME  # the story was cut before its 40 words
    assert engine.sessions[-1] is engine.sessions[0]  # one session throughout: nothing restarted it


async def test_a_step_that_never_comes_fails_the_run_and_leaves_no_task():
    # What once hung the test run: pipecat's run_test left its pipeline running when the test failed.
    engine = FakeEngine(step_s=0.05, reply="a short reply")
    async with Server(engine, ServerSettings(port=0, token="tk")) as server:
        before = asyncio.all_tasks()
        llm = OpenAIRealtimeLLMService(api_key="tk", base_url=f"ws://127.0.0.1:{server.port}/v1/realtime")
        count = Count()
        frames = [
            LLMContextFrame(LLMContext(messages=[{"role": "user", "content": "Hello."}])),
            Await(count.nth(LLMFullResponseEndFrame, 2), "second reply"),  # nothing asks for one
        ]
        with pytest.raises(TimeoutError, match="no second reply within 2 s"):
            await run_pipeline(Pipeline([llm, count]), frames, wait_s=2.0)
        assert count.nth(LLMFullResponseEndFrame, 1).is_set()  # the first reply came and ended
        assert [t for t in asyncio.all_tasks() if t not in before and not t.done()] == []
    assert engine.requests == ["Hello."]


async def test_a_registered_function_is_called_and_its_result_answered():
    """pipecat's function calling on the server: the context's tools reach the model's system turn, its
    `<tool_call>` runs the function registered with `register_function`, the result goes back as a tool
    response, and the reply to it is spoken."""
    body = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    engine = FakeEngine(step_s=0.02)
    engine.script = call_script(body)
    calls: list[dict] = []

    async def get_weather(params) -> None:
        calls.append(dict(params.arguments))
        engine.script, engine.reply = None, "It is sunny."  # the model's answer to the result
        await params.result_callback({"sky": "clear"})

    weather = FunctionSchema(
        name="get_weather", description="The weather in a city.",
        properties={"city": {"type": "string"}}, required=["city"],
    )  # fmt: skip
    async with Server(engine, ServerSettings(port=0, token="tk")) as server:
        llm = OpenAIRealtimeLLMService(api_key="tk", base_url=f"ws://127.0.0.1:{server.port}/v1/realtime")
        llm.register_function("get_weather", get_weather)
        context = LLMContext(
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=ToolsSchema(standard_tools=[weather]),
        )
        pair = LLMContextAggregatorPair(context)
        count = Count()
        frames = [LLMContextFrame(context), Await(count.nth(TTSAudioRawFrame, 1), "the answer's audio")]
        down, up = await run_pipeline(Pipeline([pair.user(), llm, count, pair.assistant()]), frames)
    assert [f for f in [*down, *up] if isinstance(f, ErrorFrame)] == []
    assert calls == [{"city": "Paris"}]
    assert '"name": "get_weather"' in engine.instructions[-1]  # the tools, in the system turn
    assert engine.requests == ["Weather in Paris?", '<tool_response>\n{"sky": "clear"}\n</tool_response>']
