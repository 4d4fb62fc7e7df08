"""Both framework adapters driven at odd moments, as an outside tester drives them with the frameworks
unmodified: chat items edited before the model heard them, turns that end while a reply waits, and engines
shared by pipelines and models that end at different times. Scripted engines (no torch sampling): the
prompts each reply was given are what the tests read; steps are ordered by events, never sleeps."""

from __future__ import annotations

import asyncio

import numpy as np
from integrations_support import scripted_engine, silence, spoken
from livekit.agents import llm
from pipecat.frames.frames import ErrorFrame, LLMMessagesAppendFrame, LLMRunFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat_support import Await, run_pipeline
from test_integrations_livekit import WAIT_S, Recorder, message, room_frames
from test_integrations_pipecat import Tap

from omni_rt.integrations.livekit import RealtimeModel
from omni_rt.integrations.pipecat import OmniRtService
from omni_rt.model.config import preset
from omni_rt.tokenizer import Tokenizer

TOK = Tokenizer.tiny(preset("tiny").ids)  # the scripted engines'
LONG = TOK.encode("Fine, thanks a lot for asking me that today. " * 6)  # a reply that talks a while


def holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def push(rt, pcm: list[np.ndarray], rate: int) -> None:
    """The pieces of audio, one after another, as room frames pushed at once (no loop turn between)."""
    for frame in room_frames(np.concatenate(pcm), rate):
        rt.push_audio(frame)


async def play(created: llm.GenerationCreatedEvent) -> int:
    """Read a generation's audio to its end, as the framework plays it; the samples it carried."""
    return sum([f.samples_per_channel async for f in (await message(created)).audio_stream])


# -- LiveKit: chat context edits ------------------------------------------------------------------------


async def test_livekit_items_deleted_or_edited_before_the_model_heard_them_are_not_said() -> None:
    """The agent adds two messages, then deletes the first and edits the second before any reply (the
    framework hands its chat context back through update_chat_ctx): the reply's prompt has the edit and not
    the deleted message, which was still sent to the model as it was first added."""
    engine = scripted_engine(TOK.encode("Fine."))
    async with engine:
        model = RealtimeModel(engine)
        rt = model.session(turn_detection_disabled=True)
        ctx = rt.chat_ctx
        ctx.add_message(role="user", content="My PIN is 1234.")
        ctx.add_message(role="user", content="Hello.")
        ctx.add_message(role="user", content="Bye.")
        await rt.update_chat_ctx(ctx)
        ctx = rt.chat_ctx
        del ctx.items[0]
        ctx.items[0].content = ["Hello there."]
        ctx.items.reverse()  # and the order of what is still unheard follows the context's
        await rt.update_chat_ctx(ctx)
        assert [i.text_content for i in rt.chat_ctx.items] == ["Bye.", "Hello there."]
        await play(await asyncio.wait_for(rt.generate_reply(), WAIT_S))
        (prompt,) = engine.prompts
        assert not holds(prompt, TOK.encode("PIN"))
        assert holds(prompt, TOK.chat_prompt([("user", "Bye."), ("user", "Hello there.")]))
        # once heard, an item cannot be removed (the caches cannot be rewound)
        ctx = rt.chat_ctx
        del ctx.items[0]
        try:
            await rt.update_chat_ctx(ctx)
        except llm.RealtimeError as e:
            assert "already heard" in str(e)
        else:
            raise AssertionError("a heard item was removed without an error")
        await rt.aclose()
        await model.aclose()


# -- LiveKit: turns ending while a reply waits ----------------------------------------------------------


async def test_livekit_turns_that_end_while_a_reply_waits_get_one_answer_not_an_empty_one() -> None:
    """omni_rt's VAD: the user talks over a reply twice, each turn ending before the reply to the one before
    could start (the reply being stopped still held the session). A new turn's speech stops the reply waiting
    for the turn before, as it stops one being made; the two turns are answered once, and no reply is made
    to nothing (the second of two waiting replies found no speech left and answered an empty turn)."""
    engine = scripted_engine(LONG)
    pcm, rate = spoken("Good morning to you")
    turn = np.concatenate([pcm, silence(1.0, rate)])
    async with engine:
        model = RealtimeModel(engine, user_transcription=False)
        rt = model.session()
        rec = Recorder(rt)
        push(rt, [silence(0.3, rate), turn], rate)
        await rec.wait("generation_created")
        push(rt, [turn, turn], rate)  # no loop turn between the frames
        await rec.wait("generation_created", 2)
        assert len(rec.of("input_speech_stopped")) == 3
        await play(rec.of("generation_created")[1])
        await asyncio.gather(*list(rt._tasks))  # any reply still owed runs to its end
        assert len(rec.of("generation_created")) == 2 and not rec.of("error")
        # every reply answers a turn: none continues from the assistant's own last turn
        assert engine.prompts and all(answers_a_turn(p) for p in engine.prompts)
        # the first reply's turn and the two after it, the latter in one reply
        assert sum(TOK.ids.audio_start == t for t in engine.prompts[-1]) == 2
        await rt.aclose()
        await model.aclose()


async def test_livekit_a_turn_the_apps_reply_answered_gets_no_second_reply() -> None:
    """The app asks for a reply (generate_reply) while the user is still speaking; the turn then ends. The
    app's reply, first in line, answers the turn; the VAD's own reply to it, behind, found nothing left and
    answered an empty turn (the model talked twice, the second time to nobody)."""
    engine = scripted_engine(LONG)
    pcm, rate = spoken("Good morning to you")
    async with engine:
        model = RealtimeModel(engine, user_transcription=False)
        rt = model.session()
        rec = Recorder(rt)
        push(rt, [silence(0.3, rate), pcm], rate)
        assert len(rec.of("input_speech_started")) == 1
        asked = rt.generate_reply()
        push(rt, [silence(1.0, rate)], rate)
        assert len(rec.of("input_speech_stopped")) == 1
        await play(await asyncio.wait_for(asked, WAIT_S))
        await asyncio.gather(*list(rt._tasks))  # any reply still owed runs to its end
        assert len(rec.of("generation_created")) == 1 and not rec.of("error")
        assert len(engine.prompts) == 1 and engine.prompts[0].count(TOK.ids.audio_start) == 1
        await rt.aclose()
        await model.aclose()


# -- engines shared by several pipelines or models ------------------------------------------------------


async def test_pipecat_a_pipeline_that_ends_leaves_the_engine_to_another_still_talking() -> None:
    """Two pipelines on one engine that nobody started (a bot per call, one engine loaded per process): the
    first to start starts it. When that one ends while the other is mid-reply, the engine keeps running
    until the last pipeline using it ends: the other reply completes (it failed, "the engine stopped")."""
    engine = scripted_engine(LONG)
    first, second = OmniRtService(engine), OmniRtService(engine)
    hold, tap = asyncio.Event(), Tap()
    statuses: list[str] = []
    second.add_event_handler("on_response_done", lambda _s, ev: statuses.append(ev.status))

    run_first = asyncio.ensure_future(run_pipeline(Pipeline([first]), [Await(hold, "the first call's end")]))
    await until_running(engine, run_first)
    hello = LLMMessagesAppendFrame(messages=[{"role": "user", "content": "Hi."}], run_llm=True)
    run_second = asyncio.ensure_future(
        run_pipeline(Pipeline([second, tap]), [hello, Await(tap.ended[0], "the second call's reply")])
    )
    await asyncio.wait_for(tap.audio[0].wait(), WAIT_S)  # the second call is talking
    hold.set()
    await run_first  # the first call ends
    _, up = await run_second
    assert statuses == ["completed"]
    assert not [f.error for f in up if isinstance(f, ErrorFrame)]
    assert not engine.running  # the last user stopped it


async def test_livekit_a_model_closed_leaves_the_engine_to_another_models_session() -> None:
    """The same with two RealtimeModels (one per job) on an engine nobody started: closing the model that
    started it does not stop the other model's reply; closing the last one stops the engine."""
    engine = scripted_engine(LONG)
    async with asyncio.timeout(WAIT_S):
        first, second = RealtimeModel(engine), RealtimeModel(engine)
        rt1 = first.session(turn_detection_disabled=True)
        await rt1._ready()  # its omni_rt session is open: the first model started the engine
        rt2 = second.session(turn_detection_disabled=True)
        rec = Recorder(rt2)
        created = await rt2.generate_reply(instructions="Talk.")
        await rt1.aclose()
        await first.aclose()
        samples = await play(created)
        (done,) = await rec.wait("metrics_collected")
        assert not rec.of("error") and not done.cancelled and samples > 0
        await rt2.aclose()
        await second.aclose()
        assert not engine.running


async def until_running(engine, run: asyncio.Task) -> None:
    """Wait until the engine runs (the first pipeline started it); a pipeline that fails first fails."""
    while not engine.running:
        if run.done():
            run.result()
            raise AssertionError("the pipeline ended before it started the engine")
        await asyncio.sleep(0)


def answers_a_turn(prompt: list[int]) -> bool:
    """The turn before the prompt's closing assistant header is not the assistant's own."""
    starts = [i for i, t in enumerate(prompt) if t == TOK.ids.im_start]
    return len(starts) < 2 or prompt[starts[-2] + 1] != TOK.ids.assistant


# -- pipecat: a tool call that pipecat cancels ----------------------------------------------------------


async def test_pipecat_a_tool_call_that_times_out_is_answered_as_cancelled() -> None:
    """A function whose handler never returns, registered with pipecat's `timeout_secs`: pipecat cancels
    the call at its deadline (a FunctionCallCancelFrame asking for inference) and the assistant aggregator
    records "CANCELLED" and asks for the reply. The model is told (as OpenAI's realtime service tells its
    model) and the reply comes; the call stayed open and nothing more was said, the user left waiting."""
    from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
    from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair

    from omni_rt.tools import TOOL_CALL, TOOL_CALL_END, tool_response

    call = [TOOL_CALL, *TOK.encode('{"name": "lookup", "arguments": {}}'), TOOL_CALL_END]
    engine = scripted_engine(call, TOK.encode("Sorry, no answer."))

    async def lookup(params) -> None:
        await asyncio.Event().wait()  # a service that never answers

    service = OmniRtService(engine)
    service.register_function("lookup", lookup, timeout_secs=0.05)
    schema = FunctionSchema(name="lookup", description="The weather.", properties={}, required=[])
    context = LLMContext(messages=[{"role": "user", "content": "Weather?"}], tools=ToolsSchema([schema]))
    pair = LLMContextAggregatorPair(context)
    tap = Tap()
    frames = [LLMRunFrame(), Await(tap.ended[1], "the reply after the cancelled call")]
    async with engine:
        await run_pipeline(Pipeline([pair.user(), service, tap, pair.assistant()]), frames)
    first, second = engine.prompts
    assert holds(second, TOK.encode(tool_response("CANCELLED")))
    assert "".join(tap.text) == "Sorry, no answer."


# -- both: a reply that fails after its turn made room ----------------------------------------------------

RAIN = "Tell me about rain. " * 90  # 1,800 tokens: two of them outgrow the 3,072 a prompt may use
SNOW = "My name is Ada. " + "Tell me about snow. " * 85


def refuse_second_submit(monkeypatch, engine) -> None:
    """The second reply's submission is refused (a full pipeline queue), after the Session dropped the
    oldest turn to make room for it: the model heard nothing of it, but the conversation is shorter."""
    from omni_rt.errors import CapacityError

    submit, calls = engine._host.submit, []

    def refusing(req) -> None:
        calls.append(req.id)
        if len(calls) == 2:
            raise CapacityError("the pipeline's queue is full")
        submit(req)

    monkeypatch.setattr(engine._host, "submit", refusing)


async def test_pipecat_words_of_a_reply_that_failed_after_a_truncation_are_kept(monkeypatch) -> None:
    """The adapters took "the conversation is as long as before" for "the model heard none of it": a reply
    refused after its turn made room had shortened it, and what the user said was lost."""
    engine = scripted_engine(TOK.encode("Fine."))
    refuse_second_submit(monkeypatch, engine)
    service = OmniRtService(engine)
    statuses: list[str] = []
    service.add_event_handler("on_response_done", lambda svc, ev: statuses.append(ev.status))
    tap = Tap()

    def user(text: str) -> LLMMessagesAppendFrame:
        return LLMMessagesAppendFrame(messages=[{"role": "user", "content": text}], run_llm=True)

    frames = [
        user(RAIN),
        Await(tap.ended[0], "the first reply's end"),
        user(SNOW),
        Await(tap.ended[1], "the refused reply's end"),
        LLMRunFrame(),
        Await(tap.ended[2], "the next reply's end"),
    ]
    async with engine:
        await run_pipeline(Pipeline([service, tap]), frames)
    assert statuses == ["completed", "failed", "completed"]
    last = engine.prompts[-1]
    assert holds(last, TOK.encode(SNOW)) and not holds(last, TOK.encode(RAIN))


async def test_livekit_words_of_a_reply_that_failed_after_a_truncation_are_kept(monkeypatch) -> None:
    engine = scripted_engine(TOK.encode("Fine."))
    refuse_second_submit(monkeypatch, engine)
    async with engine:
        model = RealtimeModel(engine)
        rt = model.session(turn_detection_disabled=True)
        rec = Recorder(rt)
        for text in (RAIN, SNOW):
            ctx = rt.chat_ctx
            ctx.add_message(role="user", content=text)
            await rt.update_chat_ctx(ctx)
            await play(await asyncio.wait_for(rt.generate_reply(), WAIT_S))
        (error,) = await rec.wait("error")
        assert "queue" in str(error.error)
        await play(await asyncio.wait_for(rt.generate_reply(), WAIT_S))
        last = engine.prompts[-1]
        assert holds(last, TOK.encode(SNOW)) and not holds(last, TOK.encode(RAIN))
        await rt.aclose()
        await model.aclose()
