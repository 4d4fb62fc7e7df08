"""omni_rt inside pipecat: espeak-ng speech goes in as audio frames through a pipeline with `OmniRtService` on
the tiny preset, and the frames out are checked, the way pipecat's own test harness (`run_test`) does it.

Steps are ordered by events, not sleeps or timeouts: an `Await` among the frames to send holds back the
frames after it until the `Tap` at the pipeline's end has seen what it waits for; `run_pipeline`
(`pipecat_support`) owns the pipeline's whole life and cancels it cleanly when a step never comes.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from integrations_support import chunks, scripted_engine, silence, spoken, tiny_engine
from loguru import logger
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.audio.turn.smart_turn.local_smart_turn_v3 import LocalSmartTurnAnalyzerV3
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.frames.frames import (
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    InputImageRawFrame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMMessagesAppendFrame,
    LLMMessagesUpdateFrame,
    LLMRunFrame,
    LLMSetToolsFrame,
    LLMTextFrame,
    LLMUpdateSettingsFrame,
    MetricsFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
    UserStartedSpeakingFrame,
    UserStoppedSpeakingFrame,
)
from pipecat.metrics.metrics import TTFBMetricsData
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.settings import LLMSettings
from pipecat.turns.user_stop import TurnAnalyzerUserTurnStopStrategy
from pipecat.turns.user_turn_processor import UserTurnProcessor
from pipecat.turns.user_turn_strategies import UserTurnStrategies
from pipecat_support import WAIT_S, Await, Count, run_pipeline, until

from omni_rt.audio.resample import resample
from omni_rt.integrations.pipecat import OmniRtService
from omni_rt.model.config import preset
from omni_rt.tokenizer import Tokenizer
from omni_rt.tools import TOOL_CALL, TOOL_CALL_END, Function, tool_response

# replies run to their limits (the tiny preset's random weights may say EOS at once): 32 codec frames, 2.56 s
REPLY = dict(max_output_tokens=48, max_audio_frames=32, ignore_eos=True)


@pytest.fixture
def engine():
    return tiny_engine()


class Tap(FrameProcessor):
    """Sets `audio[n]` at reply n's first audio frame and `ended[n]` at its end; `text` is the replies' text
    (an assistant aggregator after it takes the text frames in)."""

    def __init__(self) -> None:
        super().__init__()
        self.audio = [asyncio.Event() for _ in range(3)]
        self.ended = [asyncio.Event() for _ in range(3)]
        self.text: list[str] = []
        self._replies = 0

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            if isinstance(frame, LLMTextFrame):
                self.text.append(frame.text)
            elif isinstance(frame, TTSAudioRawFrame):
                self.audio[self._replies].set()
            elif isinstance(frame, LLMFullResponseEndFrame):
                self.ended[self._replies].set()
                self._replies += 1
        await self.push_frame(frame, direction)


def audio_frames(pcm: np.ndarray, rate: int, channels: int = 1) -> list[InputAudioRawFrame]:
    out = []
    for c in chunks(pcm, rate):
        data = np.repeat(c, channels) if channels > 1 else c  # interleaved: every sample on each channel
        out.append(
            InputAudioRawFrame(audio=data.astype("<i2").tobytes(), sample_rate=rate, num_channels=channels)
        )
    return out


def replies(frames: list[Frame]) -> list[list[Frame]]:
    """The frames from each TTSStartedFrame up to the next one."""
    out: list[list[Frame]] = []
    for f in frames:
        if isinstance(f, TTSStartedFrame):
            out.append([])
        if out:
            out[-1].append(f)
    return out


def ttfbs(frames: list[Frame], service: OmniRtService) -> list[float]:
    return [
        d.value
        for f in frames
        if isinstance(f, MetricsFrame)
        for d in f.data
        if isinstance(d, TTFBMetricsData) and d.processor == service.name and d.value > 0
    ]  # (the worker's initial metrics frame says 0.0 for every processor)


def check_interrupted_reply_stopped(down: list[Frame], done: list) -> None:
    """Reply 1 was cancelled mid-way; after the interruption no audio of it went out, and reply 2 came."""
    assert [d.status for d in done] == ["cancelled", "completed"], [d.status for d in done]
    cut = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame) and i > down.index(
        next(f for f in down if isinstance(f, TTSAudioRawFrame))))  # fmt: skip
    nxt = next(i for i in range(cut, len(down)) if isinstance(down[i], TTSStartedFrame))
    assert not any(isinstance(f, TTSAudioRawFrame) for f in down[cut:nxt]), "audio after the interruption"
    first, second = replies(down)
    assert isinstance(first[-1], TTSStoppedFrame) or any(isinstance(f, TTSStoppedFrame) for f in first)
    # the engine stopped reply 1 early: less audio than the reply's limit, and all of it was delivered
    n1 = sum(f.num_frames for f in first if isinstance(f, TTSAudioRawFrame))
    assert 0 < n1 < REPLY["max_audio_frames"] * 1920
    assert abs(n1 / 24000 - done[0].metrics.audio_seconds) < 1e-6
    n2 = sum(f.num_frames for f in second if isinstance(f, TTSAudioRawFrame))
    assert n2 > 0 and abs(n2 / 24000 - done[1].metrics.audio_seconds) < 1e-6
    assert all(
        f.sample_rate == 24000 and f.num_channels == 1
        for f in first + second
        if isinstance(f, TTSAudioRawFrame)
    )


def check_first_audio_metrics(down: list[Frame], service: OmniRtService, done: list) -> None:
    """One TTFB per reply, and each is the engine's own time to first audio (its clock starts a hair later)."""
    got = ttfbs(down, service)
    assert len(got) == 2, got
    for ttfb, d in zip(got, done, strict=True):
        assert ttfb > 0 and d.metrics.ttfa_ms is not None
        assert -0.005 < ttfb - d.metrics.ttfa_ms / 1000 < 0.25, (ttfb, d.metrics.ttfa_ms)


async def test_pipecat_vad_and_turn_analyzer_drive_turns_and_barge_in(engine) -> None:
    """pipecat's Silero VAD and smart-turn analyzer cut the turns: the user speaks, the reply starts, the
    user talks over it (pipecat's interruption stops it at once), and the second turn is answered."""
    hello, rate = spoken("Good morning to you")
    again, _ = spoken("Say that once more")
    hello16, again16 = (resample(x.astype(np.float32) / 32768, rate, 16000) for x in (hello, again))
    hello16, again16 = ((np.clip(x, -1, 1) * 32767).astype(np.int16) for x in (hello16, again16))

    service = OmniRtService(engine, **REPLY)
    done: list = []
    service.add_event_handler("on_response_done", lambda _s, ev: done.append(ev))
    tap = Tap()
    # the smart-turn model decides the end of a turn from the audio alone: no transcript to wait for
    stop = TurnAnalyzerUserTurnStopStrategy(
        turn_analyzer=LocalSmartTurnAnalyzerV3(), wait_for_transcript=False
    )
    turns = UserTurnStrategies(stop=[stop])
    pipeline = Pipeline([
        VADProcessor(vad_analyzer=SileroVADAnalyzer()), UserTurnProcessor(user_turn_strategies=turns),
        service, tap,
    ])  # fmt: skip
    tail = silence(1.0, 16000)
    frames = [
        *audio_frames(np.concatenate([silence(0.3, 16000), hello16, tail]), 16000),
        Await(tap.audio[0], "reply 1's first audio"),  # reply 1 is playing: talk over it
        *audio_frames(np.concatenate([again16, tail]), 16000),
        Await(tap.ended[1], "reply 2's end"),
    ]
    async with engine:
        down, _ = await run_pipeline(
            pipeline, frames,
            PipelineParams(enable_metrics=True, enable_usage_metrics=True, audio_in_sample_rate=16000),
        )  # fmt: skip
    types = [type(f) for f in down]
    assert types.count(UserStartedSpeakingFrame) == 2 and types.count(UserStoppedSpeakingFrame) == 2
    check_interrupted_reply_stopped(down, done)
    check_first_audio_metrics(down, service, done)
    assert any(isinstance(f, TTSTextFrame) for f in down)


async def test_omni_rt_vad_setting_any_rate_and_an_interruption_frame(engine) -> None:
    """turn_detection="omni_rt": the service cuts turns from 22.05 kHz stereo frames (downmixed, resampled
    once) and broadcasts the user-turn frames; an InterruptionFrame sent mid-reply stops the reply within a
    codec frame; the next spoken turn is answered."""
    hello, rate = spoken("Good morning to you")
    again, _ = spoken("Tell me more")
    service = OmniRtService(engine, turn_detection="omni_rt", **REPLY)
    done: list = []
    service.add_event_handler("on_response_done", lambda _s, ev: done.append(ev))
    tap = Tap()
    tail = silence(1.0, rate)
    frames = [
        *audio_frames(np.concatenate([silence(0.3, rate), hello, tail]), rate, channels=2),
        Await(tap.audio[0], "reply 1's first audio"),
        InterruptionFrame(),
        *audio_frames(np.concatenate([again, tail]), rate, channels=2),
        Await(tap.ended[1], "reply 2's end"),
    ]
    async with engine:
        down, up = await run_pipeline(Pipeline([service, tap]), frames, PipelineParams(enable_metrics=True))
    for frames_seen in (down, up):  # broadcast both ways, as pipecat's realtime services do
        types = [type(f) for f in frames_seen]
        assert types.count(UserStartedSpeakingFrame) == 2 and types.count(UserStoppedSpeakingFrame) == 2
    check_interrupted_reply_stopped(down, done)
    check_first_audio_metrics(down, service, done)


async def test_a_malformed_audio_frame_is_an_error_upstream_and_the_service_goes_on(engine) -> None:
    service = OmniRtService(engine, turn_detection="omni_rt", **REPLY)
    good = audio_frames(silence(0.2, 16000), 16000)
    frames = [InputAudioRawFrame(audio=b"\x00\x00\x00", sample_rate=16000, num_channels=1), *good]
    async with engine:
        down, up = await run_pipeline(service, frames)
    errors = [f for f in up if isinstance(f, ErrorFrame)]
    assert len(errors) == 1 and "whole int16 samples" in errors[0].error
    assert sum(isinstance(f, InputAudioRawFrame) for f in down) == len(good)  # the rest went through


class HoldStart(FrameProcessor):
    """Keeps the StartFrame from the end of the pipeline (which so never starts); `reached` is set when it
    comes, after every processor before this one has started."""

    def __init__(self) -> None:
        super().__init__()
        self.reached = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, StartFrame):
            self.reached.set()
            await asyncio.Event().wait()  # until the pipeline's cleanup cancels it
        await self.push_frame(frame, direction)


async def cancel_at(event: asyncio.Event, what: str, run) -> None:
    """Run `run` (a coroutine) until `event`, then cancel it as a failing test's end does, and wait for it."""
    task = asyncio.ensure_future(run)
    await until(event, task, WAIT_S, what)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def tasks_left(before: set[asyncio.Task]) -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t not in before and not t.done()]


async def test_a_run_cancelled_mid_reply_stops_the_reply_and_gives_the_session_back(engine) -> None:
    """A test that fails while a reply is being spoken: the pipeline is cancelled (a CancelFrame), the engine
    stops the reply, no task of the pipeline or the service is left, and the session's slot is free again."""
    hello, rate = spoken("Good morning to you")
    service = OmniRtService(engine, turn_detection="omni_rt", **REPLY)
    done: list = []
    service.add_event_handler("on_response_done", lambda _s, ev: done.append(ev))
    tap = Tap()
    frames = [
        *audio_frames(np.concatenate([hello, silence(1.0, rate)]), rate),
        Await(asyncio.Event(), "the end"),
    ]
    before, slots = asyncio.all_tasks(), engine.capacity.sessions
    async with engine:
        await cancel_at(tap.audio[0], "reply 1's first audio", run_pipeline(Pipeline([service, tap]), frames))
        assert tasks_left(before) == []
        assert service.session is None and engine.capacity.sessions == slots
    assert [d.status for d in done] == ["cancelled"]


async def test_a_run_cancelled_before_the_pipeline_started_gives_the_session_back(engine) -> None:
    """The service has its session once it has started, but pipecat sends no CancelFrame into a pipeline
    whose StartFrame has not reached its end, only cleans it up: the cleanup gives the session back."""
    service = OmniRtService(engine, **REPLY)
    hold = HoldStart()
    before, slots = asyncio.all_tasks(), engine.capacity.sessions
    async with engine:
        await cancel_at(hold.reached, "the service's start", run_pipeline(Pipeline([service, hold]), []))
        assert tasks_left(before) == []
        assert service.session is None and engine.capacity.sessions == slots


async def test_a_pipeline_that_does_not_start_in_time_fails_the_run_and_leaves_no_task(engine) -> None:
    """The failure that once hung the test run (pipecat's run_test gave up on a slow start and left its
    pipeline running): the run fails with a TimeoutError, and nothing of the pipeline is left behind."""
    service = OmniRtService(engine, **REPLY)
    before, slots = asyncio.all_tasks(), engine.capacity.sessions
    async with engine:
        with pytest.raises(TimeoutError, match="the pipeline to start"):
            await run_pipeline(Pipeline([service, HoldStart()]), [], wait_s=0.5)
        assert tasks_left(before) == []
        assert service.session is None and engine.capacity.sessions == slots


def holds(conversation: list[int], ids: list[int]) -> bool:
    return any(conversation[i : i + len(ids)] == ids for i in range(len(conversation) - len(ids) + 1))


async def test_text_messages_run_frames_and_settings_updates(engine) -> None:
    """pipecat's own frames drive text turns: LLMUpdateSettingsFrame's system_instruction becomes the system
    turn (nothing was said yet) and its max_tokens the reply limit; LLMMessagesAppendFrame's text joins the
    next reply, which run_llm (or an LLMRunFrame) starts; what omni_rt cannot do (replacing the context
    the model has heard) is an ErrorFrame upstream, and the pipeline goes on; tools are taken."""
    service = OmniRtService(engine, **REPLY)
    said: list[tuple[str, list[int]]] = []  # each reply's status and the conversation after it

    async def on_done(svc, ev) -> None:
        said.append((ev.status, list(svc.session.conversation), ev.usage.output_tokens))

    service.add_event_handler("on_response_done", on_done)
    tap = Tap()
    weather = FunctionSchema(name="weather", description="The weather", properties={}, required=[])
    frames = [
        LLMUpdateSettingsFrame(delta=LLMSettings(system_instruction="You are a pirate.", max_tokens=8)),
        LLMMessagesAppendFrame(messages=[{"role": "user", "content": "My name is Ada."}]),
        LLMMessagesAppendFrame(
            messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}], run_llm=True
        ),
        Await(tap.ended[0], "reply 1's end"),
        LLMMessagesAppendFrame(messages=[{"role": "system", "content": "Speak slowly."}]),
        LLMRunFrame(),
        Await(tap.ended[1], "reply 2's end"),
        LLMSetToolsFrame(tools=ToolsSchema(standard_tools=[weather])),
        LLMMessagesUpdateFrame(messages=[{"role": "user", "content": "Forget all that."}]),
    ]
    async with engine:
        down, up = await run_pipeline(Pipeline([service, tap]), frames)
    tok = engine.tokenizer
    (s1, c1, n1), (s2, c2, n2) = said
    assert s1 == s2 == "completed" and 0 < n1 <= 8 and 0 < n2 <= 8
    first = [("system", "You are a pirate."), ("user", "My name is Ada."), ("user", "Say hi.")]
    assert c1[: len(tok.chat_prompt(first))] == tok.chat_prompt(first)
    assert holds(c2[len(c1) :], tok.chat_prompt([("system", "Speak slowly.")]))
    assert len(replies(down)) == 2 and all(
        any(isinstance(f, TTSAudioRawFrame) for f in r) for r in replies(down)
    )
    errors = [f.error for f in up if isinstance(f, ErrorFrame)]
    assert len(errors) == 1 and "LLMMessagesUpdateFrame" in errors[0], errors


async def test_an_interruption_keeps_what_a_dropped_reply_would_have_answered(engine) -> None:
    """A reply owed behind the one being made is dropped by an interruption, but what it would have answered
    is not: the messages (and speech) it carried join the next reply."""
    service = OmniRtService(engine, **REPLY)
    said: list[list[int]] = []
    service.add_event_handler("on_response_done", lambda svc, ev: said.append(list(svc.session.conversation)))
    tap, count = Tap(), Count()
    frames = [
        LLMMessagesAppendFrame(messages=[{"role": "user", "content": "Say hi."}], run_llm=True),
        Await(tap.audio[0], "reply 1's first audio"),
        LLMMessagesAppendFrame(messages=[{"role": "user", "content": "My name is Ada."}], run_llm=True),
        Await(count.nth(LLMMessagesAppendFrame, 2), "the second message"),  # owed behind reply 1
        InterruptionFrame(),
        LLMRunFrame(),
        Await(tap.ended[1], "the next reply's end"),
    ]
    async with engine:
        await run_pipeline(Pipeline([service, tap, count]), frames)
    assert len(said) == 2  # reply 1 (cancelled) and the one after the interruption
    ada = engine.tokenizer.chat_prompt([("user", "My name is Ada.")])
    assert not holds(said[0], ada) and holds(said[1], ada)


async def test_a_reply_refused_as_too_long_keeps_the_users_speech_for_the_next(engine) -> None:
    """A spoken turn whose reply is refused (the text sent with it does not fit the context): an ErrorFrame
    upstream, and the user's speech, which the model never heard, is what the next reply answers."""
    hello, rate = spoken("Good morning to you")
    service = OmniRtService(engine, **REPLY)
    said: list[tuple[str, list[int]]] = []
    service.add_event_handler(
        "on_response_done", lambda svc, ev: said.append((ev.status, list(svc.session.conversation)))
    )
    tap, count = Tap(), Count()
    frames = [
        LLMMessagesAppendFrame(messages=[{"role": "system", "content": "Be brief. " * 20000}]),
        Await(count.nth(LLMMessagesAppendFrame, 1), "the long message"),
        UserStartedSpeakingFrame(),
        *audio_frames(np.concatenate([hello, silence(0.3, rate)]), rate),
        UserStoppedSpeakingFrame(),
        Await(tap.ended[0], "the refused reply's end"),
        LLMRunFrame(),
        Await(tap.ended[1], "the next reply's end"),
    ]
    async with engine:
        down, up = await run_pipeline(Pipeline([service, tap, count]), frames)
    assert [s for s, _ in said] == ["failed", "completed"]
    assert any(isinstance(f, ErrorFrame) and "context" in f.error for f in up)
    audio_start = 151669  # <|audio_start|>: a spoken turn in the model's conversation
    assert audio_start not in said[0][1] and audio_start in said[1][1]


async def test_words_refused_twice_are_dropped_not_kept_for_every_reply(engine) -> None:
    """A user message too long for the context was kept for the next reply each time it was refused, so
    every reply after it failed, whatever the user said next. Kept once: refused again, it is dropped, and
    what the user said beside it is answered."""
    service = OmniRtService(engine, **REPLY)
    said: list[tuple[str, list[int]]] = []
    service.add_event_handler(
        "on_response_done", lambda svc, ev: said.append((ev.status, list(svc.session.conversation)))
    )
    tap = Tap()

    def user(text: str) -> LLMMessagesAppendFrame:
        return LLMMessagesAppendFrame(messages=[{"role": "user", "content": text}], run_llm=True)

    frames = [
        user("Hello. " * 20000),
        Await(tap.ended[0], "the refused reply's end"),
        user("My name is Ada."),
        Await(tap.ended[1], "the second reply's end"),
        user("Thanks."),
        Await(tap.ended[2], "the third reply's end"),
    ]
    async with engine:
        down, up = await run_pipeline(Pipeline([service, tap]), frames)
    assert [s for s, _ in said] == ["failed", "failed", "completed"]
    # the words refused beside the long message, then the new ones
    ada = engine.tokenizer.chat_prompt([("user", "My name is Ada."), ("user", "Thanks.")])
    assert holds(said[2][1], ada[:-3]) and not holds(said[2][1], engine.tokenizer.encode("Hello. " * 4))


async def test_video_input_is_one_clear_error_and_passes_on(engine) -> None:
    """omni_rt hears no video: the first image frame is an ErrorFrame upstream (once, not per frame), and
    the frames go on to the rest of the pipeline."""
    service = OmniRtService(engine, **REPLY)
    images = [InputImageRawFrame(image=bytes(12), size=(2, 2), format="RGB") for _ in range(3)]
    async with engine:
        down, up = await run_pipeline(service, images)
    errors = [f.error for f in up if isinstance(f, ErrorFrame)]
    assert len(errors) == 1 and "video" in errors[0], errors
    assert sum(isinstance(f, InputImageRawFrame) for f in down) == 3


async def test_with_a_context_aggregator_the_first_context_starts_the_conversation(engine) -> None:
    """pipecat's usual pipeline, a context aggregator pair around the service: the aggregator turns the app's
    LLMRunFrame into an LLMContextFrame, and the first one starts the conversation with its text messages
    (as pipecat's own realtime services do); later context frames start nothing, so a spoken turn after it
    is answered once."""
    hello, rate = spoken("Good morning to you")
    service = OmniRtService(engine, turn_detection="omni_rt", **REPLY)
    said: list[tuple[str, list[int]]] = []
    service.add_event_handler(
        "on_response_done", lambda svc, ev: said.append((ev.status, list(svc.session.conversation)))
    )
    context = LLMContext(messages=[{"role": "system", "content": "Greet the caller."}])
    pair = LLMContextAggregatorPair(context)
    tap = Tap()
    frames = [
        LLMRunFrame(),
        Await(tap.ended[0], "the greeting's end"),
        *audio_frames(np.concatenate([silence(0.3, rate), hello, silence(1.0, rate)]), rate),
        Await(tap.ended[1], "the answer to the turn"),
    ]
    async with engine:
        await run_pipeline(Pipeline([pair.user(), service, tap, pair.assistant()]), frames)
    assert [s for s, _ in said] == ["completed", "completed"]
    greet = engine.tokenizer.chat_prompt([("system", "Greet the caller.")])
    assert said[0][1][: len(greet)] == greet
    assert not tap.ended[2].is_set()  # one reply to the turn


def tool_call(tok, name: str, arguments: str) -> list[int]:
    """The Thinker's ids of one call, between the template's special tokens."""
    return [TOOL_CALL, *tok.encode(f'{{"name": "{name}", "arguments": {arguments}}}'), TOOL_CALL_END]


@pytest.mark.parametrize("city", ["Paris", "Atlantis"])
async def test_function_calls_run_through_register_function_and_their_results_are_answered(city) -> None:
    """pipecat's function calling, on a scripted Thinker, in the usual pipeline (a context aggregator pair
    around the service): the context's tools are in the system prompt; the reply's <tool_call> runs the
    handler given to register_function with the parsed arguments (nothing of the call is shown as text);
    its result goes back through the assistant aggregator as the template's <tool_response>, and the
    service answers it. A handler that raises (Atlantis) is answered as pipecat answers it: an ErrorFrame
    and its error result, which the model is told."""
    from pipecat.services.llm_service import FunctionCallParams

    tok = Tokenizer.tiny(preset("tiny").ids)  # the scripted engine's
    engine = scripted_engine(
        tok.encode("Let me check.") + tool_call(tok, "lookup", json.dumps({"city": city})),
        tok.encode("It is sunny."),
    )
    asked: list[str] = []

    async def lookup(params: FunctionCallParams) -> None:
        asked.append(params.arguments["city"])
        if params.arguments["city"] == "Atlantis":
            raise RuntimeError("no such city")
        await params.result_callback({"sky": "sunny"})

    schema = FunctionSchema(
        name="lookup", description="The weather in a city.",
        properties={"city": {"type": "string"}}, required=["city"],
    )  # fmt: skip
    service = OmniRtService(engine, instructions="You are brief.")
    service.register_function("lookup", lookup)
    context = LLMContext(
        messages=[{"role": "user", "content": f"Weather in {city}?"}], tools=ToolsSchema([schema])
    )
    pair = LLMContextAggregatorPair(context)
    tap = Tap()
    frames = [LLMRunFrame(), Await(tap.ended[1], "the answer to the tool's result")]
    async with engine:
        down, up = await run_pipeline(Pipeline([pair.user(), service, tap, pair.assistant()]), frames)
    assert asked == [city]
    first, second = engine.prompts
    system = tok.last_turn(first, "system")
    assert system.startswith("You are brief.\n\n# Tools") and '"name": "lookup"' in system
    result = json.dumps(  # as pipecat's context aggregator records it
        {"sky": "sunny"}
        if city == "Paris"
        else service.FUNCTION_CALL_ERROR_MESSAGE_TEMPLATE.format(function_name="lookup")
    )
    assert holds(second, tok.encode(tool_response(result)))
    # the answer says the tools once, in the first turn (the special tokens of the template's text made
    # the prompt look changed: every later reply repeated the whole system prompt as a turn of its own)
    system_turn = [tok.ids.im_start, tok.ids.system]
    assert sum(second[i : i + 2] == system_turn for i in range(len(second))) == 1
    assert "".join(tap.text) == "Let me check.It is sunny."  # the text: nothing of the call
    errors = [f.error for f in up if isinstance(f, ErrorFrame)]
    assert errors == ([] if city == "Paris" else [errors[0]]) and all("no such city" in e for e in errors)
    # the context aggregator recorded the call and its result, as with any pipecat LLM
    assert [m["content"] for m in context.get_messages() if m.get("role") == "tool"] == [result]


def test_a_call_with_no_result_is_answered_as_completed() -> None:
    # pipecat's context aggregator records a falsy result as "COMPLETED" (and runs no reply for it); the
    # model's next turn said "null"
    from pipecat.frames.frames import FunctionCallResultFrame

    from omni_rt.integrations.pipecat_tools import ToolCalls

    calls = ToolCalls(service=None)
    for result, said in ((None, "COMPLETED"), ("", "COMPLETED"), ({"ok": 1}, '{"ok": 1}')):
        calls._open.add("call_1")
        frame = FunctionCallResultFrame(function_name="f", tool_call_id="call_1", arguments={}, result=result)
        assert calls.result(frame) == ("user", tool_response(said))


async def test_a_malformed_tool_choice_is_an_error_and_changes_nothing() -> None:
    # {"function": "lookup"} (no name object) raised AttributeError out of the frame's processing; an
    # unknown string was taken as it was
    from omni_rt.integrations.pipecat_tools import ToolCalls

    class Service:
        errors: list[str] = []

        async def push_error(self, message: str) -> None:
            self.errors.append(message)

    calls = ToolCalls(Service())
    await calls.set_context(LLMContext(tool_choice={"type": "function", "function": {"name": "lookup"}}))
    assert calls.choice == Function("lookup")
    for bad in ({"type": "function", "function": "lookup"}, "sometimes", {"type": "function"}):
        await calls.set_context(LLMContext(tool_choice=bad))
        assert calls.choice == Function("lookup")
    assert len(Service.errors) == 3 and all("unknown tool_choice" in e for e in Service.errors)
    await calls.set_context(LLMContext(tool_choice="none"))
    assert calls.choice == "none"


async def test_a_malformed_tool_call_is_an_error_and_runs_nothing() -> None:
    """A call of a tool the service was not given (LLMSetToolsFrame, no aggregator): an ErrorFrame, no
    handler runs, nothing of it is shown; the next reply is made as usual."""
    tok = Tokenizer.tiny(preset("tiny").ids)
    engine = scripted_engine(tool_call(tok, "rm_rf", "{}"), tok.encode("Fine."))
    ran: list = []
    service = OmniRtService(engine)
    service.register_function(None, lambda params: ran.append(params))  # any function at all
    schema = FunctionSchema(name="lookup", description="The weather.", properties={}, required=[])
    tap = Tap()
    frames = [
        LLMSetToolsFrame(tools=ToolsSchema([schema])),
        LLMMessagesAppendFrame(messages=[{"role": "user", "content": "Clean up."}], run_llm=True),
        Await(tap.ended[0], "the malformed call's reply"),
        LLMRunFrame(),
        Await(tap.ended[1], "the next reply"),
    ]
    logged: list[str] = []
    sink = logger.add(logged.append, level="ERROR")
    try:
        async with engine:
            down, up = await run_pipeline(Pipeline([service, tap]), frames)
    finally:
        logger.remove(sink)
    assert not [m for m in logged if "NOT_GIVEN" in m]  # the service's settings are all set
    assert ran == [] and len(engine.prompts) == 2
    assert "".join(tap.text) == "Fine."
    errors = [f.error for f in up if isinstance(f, ErrorFrame)]
    assert len(errors) == 1 and "malformed tool call" in errors[0] and "rm_rf" in errors[0], errors


async def test_tools_with_one_name_twice_are_an_error_and_change_nothing() -> None:
    """Two tools of one name (a call of it would run either): an ErrorFrame, and the tools stay as they
    were; they were both offered."""
    tok = Tokenizer.tiny(preset("tiny").ids)
    engine = scripted_engine(tok.encode("Fine."))
    service = OmniRtService(engine)
    lookup = FunctionSchema(name="lookup", description="The weather.", properties={}, required=[])
    other = FunctionSchema(name="lookup", description="The news.", properties={}, required=[])
    tap = Tap()
    frames = [
        LLMSetToolsFrame(tools=ToolsSchema([lookup])),
        LLMSetToolsFrame(tools=ToolsSchema([lookup, other])),
        LLMMessagesAppendFrame(messages=[{"role": "user", "content": "Hi."}], run_llm=True),
        Await(tap.ended[0], "the reply"),
    ]
    async with engine:
        down, up = await run_pipeline(Pipeline([service, tap]), frames)
    errors = [f.error for f in up if isinstance(f, ErrorFrame)]
    assert len(errors) == 1 and "unique" in errors[0] and "'lookup'" in errors[0], errors
    system = tok.last_turn(engine.prompts[0], "system")
    assert "The weather." in system and "The news." not in system


async def test_a_pipeline_started_with_no_free_slot_says_so_and_opens_at_a_later_reply(engine) -> None:
    """Every engine slot taken when the pipeline started: the service's session failed to open in its
    StartFrame (pipecat only logged it), and every reply after was dropped without a frame, even once
    slots were free. Now such a reply is an ErrorFrame that says why, and a later one opens the session."""
    from omni_rt.errors import SessionLimitError

    service = OmniRtService(engine, **REPLY)
    said: list[tuple[str, list[int]]] = []
    service.add_event_handler(
        "on_response_done", lambda svc, ev: said.append((ev.status, list(svc.session.conversation)))
    )
    tap, count = Tap(), Count()
    taken: list = []
    freed = asyncio.Event()

    async def free() -> None:
        for s in taken:
            await s.close()
        freed.set()

    class Refused(FrameProcessor):
        """Frees the slots once the service's error for the first reply has gone upstream past it."""

        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, ErrorFrame) and not freed.is_set():
                await free()
            await self.push_frame(frame, direction)

    def user(text: str) -> LLMMessagesAppendFrame:
        return LLMMessagesAppendFrame(messages=[{"role": "user", "content": text}], run_llm=True)

    async with engine:
        with pytest.raises(SessionLimitError):
            while True:
                taken.append(engine.session(voice="ethan"))
        frames = [
            user("Hello."),
            Await(freed, "the first reply's error"),
            user("Hi."),
            Await(tap.ended[0], "the reply"),
        ]
        down, up = await run_pipeline(Pipeline([Refused(), service, tap, count]), frames)
    errors = [f.error for f in up if isinstance(f, ErrorFrame)]
    assert len(errors) == 1 and "session slots" in errors[0], errors
    assert [s for s, _ in said] == ["completed"]  # what the refused reply answered waited for this one
    hello = engine.tokenizer.chat_prompt([("user", "Hello."), ("user", "Hi.")])[:-3]
    assert holds(said[0][1], hello)
