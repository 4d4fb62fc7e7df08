"""omni_rt as a LiveKit Agents realtime model: the `RealtimeSession` driven directly, as `AgentSession` drives
it, without a LiveKit server, on the tiny preset, with espeak-ng speech pushed as room audio frames."""

from __future__ import annotations

import asyncio
import json
import logging

import numpy as np
import pytest
from integrations_support import chunks, scripted_engine, silence, spoken, tiny_engine
from livekit import rtc
from livekit.agents import llm

from omni_rt.audio.resample import resample
from omni_rt.integrations.livekit import RealtimeModel
from omni_rt.tools import TOOL_CALL, TOOL_CALL_END, tool_response

WAIT_S = 120.0
REPLY = dict(max_output_tokens=48, max_audio_frames=32, ignore_eos=True)  # runs to its limits: 2.56 s


@pytest.fixture
def engine():
    return tiny_engine()


def room_frames(pcm: np.ndarray, rate: int, out_rate: int = 48000, channels: int = 2) -> list[rtc.AudioFrame]:
    """int16 speech as a LiveKit room delivers it: 48 kHz stereo, 10 ms frames."""
    x = resample(pcm.astype(np.float32) / 32768, rate, out_rate)
    x = (np.clip(x, -1, 1) * 32767).astype(np.int16)
    out = []
    for c in chunks(x, out_rate, ms=10):
        out.append(rtc.AudioFrame(np.repeat(c, channels).tobytes(), out_rate, channels, len(c)))
    return out


class Recorder:
    """Every event of a session, in order; `wait(name, n)` returns once `n` of that event came."""

    NAMES = (
        "input_speech_started",
        "input_speech_stopped",
        "generation_created",
        "metrics_collected",
        "error",
    )

    def __init__(self, rt: llm.RealtimeSession) -> None:
        self.events: list[tuple[str, object]] = []
        self._changed = asyncio.Event()
        for name in self.NAMES:
            rt.on(name, lambda ev, name=name: self._add(name, ev))

    def _add(self, name: str, ev: object) -> None:
        self.events.append((name, ev))
        self._changed.set()

    def of(self, name: str) -> list:
        return [ev for n, ev in self.events if n == name]

    async def wait(self, name: str, n: int = 1) -> list:
        async def until() -> None:
            while len(self.of(name)) < n:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(until(), WAIT_S)
        return self.of(name)


def say_and_commit(rt: llm.RealtimeSession) -> None:
    """The user says "Good morning to you" in room audio, and the framework ends the turn."""
    pcm, rate = spoken("Good morning to you")
    for frame in room_frames(np.concatenate([pcm, silence(0.3, rate)]), rate):
        rt.push_audio(frame)
    rt.commit_audio()


def sessions_of(model: RealtimeModel) -> list:
    """The realtime sessions `model` opens from now on, in order (an AgentSession opens its own)."""
    opened: list = []
    session_of = model.session
    model.session = lambda **kw: opened.append(session_of(**kw)) or opened[-1]
    return opened


async def message(created: llm.GenerationCreatedEvent) -> llm.MessageGeneration:
    async for msg in created.message_stream:
        return msg
    raise AssertionError("a generation without a message")


async def test_generate_reply_interrupt_truncate_and_a_second_reply(engine) -> None:
    """Framework-driven turns: the user's speech is pushed and committed, generate_reply(instructions) answers
    with audio frames; interrupt() ends the audio stream at once; truncate() shortens the assistant item to
    what was played; a second reply works; metrics carry the time to first audio."""
    async with engine:
        model = RealtimeModel(engine, **REPLY)
        rt = model.session(turn_detection_disabled=True)
        rec = Recorder(rt)
        say_and_commit(rt)
        created = await asyncio.wait_for(rt.generate_reply(instructions="Answer briefly."), WAIT_S)
        assert created.user_initiated and created.response_id
        msg = await message(created)
        assert await msg.modalities == ["audio", "text"]

        got, after = [], 0
        async for frame in msg.audio_stream:
            if len(got) >= 3:  # interrupted: nothing may come after
                after += 1
                continue
            got.append(frame)
            if len(got) == 3:  # 1 + 2 + 4 codec frames: the reply is well under way, not done (32)
                rt.interrupt()
        assert after == 0 and all(f.sample_rate == 24000 and f.num_channels == 1 for f in got)
        played_ms = sum(f.samples_per_channel for f in got) / 24
        first = (await rec.wait("metrics_collected"))[0]
        assert first.cancelled and first.ttft > 0 and first.request_id == created.response_id
        # the reply's instructions: a system turn before the spoken one (they were user text beside it)
        conv, ids = rt.omni_session.conversation, engine.cfg.ids
        assert engine.tokenizer.last_turn(conv, "system") == "Answer briefly."
        assert conv.index(ids.system) < conv.index(ids.audio_start)
        assert "Answer briefly." not in engine.tokenizer.last_turn(conv, "user")

        ctx = rt.chat_ctx
        assert [(i.role) for i in ctx.items] == ["user", "assistant"]
        assert isinstance(ctx.items[0].content[0], llm.AudioContent) and ctx.items[1].interrupted
        full = ctx.items[1].text_content
        rt.truncate(message_id=msg.message_id, modalities=["audio", "text"], audio_end_ms=int(played_ms // 2))
        cut = rt.chat_ctx.get_by_id(msg.message_id).text_content
        assert cut and full.startswith(cut) and len(cut) < len(full), (cut, full)
        rt.truncate(
            message_id=msg.message_id, modalities=["audio"], audio_end_ms=100, audio_transcript="Good"
        )
        assert rt.chat_ctx.get_by_id(msg.message_id).text_content == "Good"  # the framework's own alignment
        rt.truncate(
            message_id=msg.message_id, modalities=["audio", "text"], audio_end_ms=int(played_ms) + 500
        )
        assert isinstance((await rec.wait("error"))[0].error, llm.RealtimeError)  # past the audio

        second = await asyncio.wait_for(rt.generate_reply(), WAIT_S)
        frames = [f async for f in (await message(second)).audio_stream]
        done = (await rec.wait("metrics_collected", 2))[1]
        assert not done.cancelled and done.ttft > 0
        samples = sum(f.samples_per_channel for f in frames)
        assert 31 * 1920 < samples <= 32 * 1920  # the whole reply, to its limit of 32 codec frames
        assert [i.role for i in rt.chat_ctx.items] == ["user", "assistant", "assistant"]
        await rt.aclose()
        await model.aclose()


async def test_server_vad_turns_and_chat_context(engine) -> None:
    """omni_rt's VAD cuts the turn from pushed room audio and answers it on its own (user_initiated=False);
    instructions set before the first reply become its system turn; chat items added join the prompt."""
    pcm, rate = spoken("Good morning to you")
    async with engine:
        model = RealtimeModel(engine, **REPLY)
        rt = model.session()
        rec = Recorder(rt)
        await rt.update_instructions("You are a pirate.")
        chat = rt.chat_ctx
        chat.add_message(role="user", content="My name is Ada.")
        await rt.update_chat_ctx(chat)
        for frame in room_frames(np.concatenate([silence(0.3, rate), pcm, silence(1.0, rate)]), rate):
            rt.push_audio(frame)
        created = (await rec.wait("generation_created"))[0]
        assert not created.user_initiated
        frames = [f async for f in (await message(created)).audio_stream]
        assert 31 * 1920 < sum(f.samples_per_channel for f in frames) <= 32 * 1920
        names = [n for n, _ in rec.events]
        assert (
            names.index("input_speech_started")
            < names.index("input_speech_stopped")
            < names.index("generation_created")
        )
        await rec.wait("metrics_collected")
        tok = engine.tokenizer
        conversation = rt.omni_session.conversation
        for text in ("You are a pirate.", "My name is Ada."):
            ids = tok.encode(text)
            assert any(conversation[i : i + len(ids)] == ids for i in range(len(conversation))), text
        # chat context out: the text item, then the spoken turn, then the reply
        items = rt.chat_ctx.items
        assert (items[0].role, items[0].text_content) == ("user", "My name is Ada.")
        assert items[1].role == "user" and isinstance(items[1].content[0], llm.AudioContent)  # (+ transcript)
        assert rt.chat_ctx.items[2].role == "assistant" and rt.chat_ctx.items[2].text_content
        with pytest.raises(llm.RealtimeError):
            await rt.update_chat_ctx(llm.ChatContext.empty())  # the model has heard these
        # later instructions: a system turn ahead of the next reply, with the reply's own instructions
        await rt.update_instructions("Speak slowly.")
        created = await asyncio.wait_for(rt.generate_reply(instructions="Say goodbye."), WAIT_S)
        assert [f async for f in (await message(created)).audio_stream]
        conversation = rt.omni_session.conversation
        system = tok.chat_prompt([("system", "Speak slowly."), ("system", "Say goodbye.")])
        assert any(conversation[i : i + len(system)] == system for i in range(len(conversation)))
        await rt.aclose()
        await model.aclose()


async def test_agent_session_without_a_server(engine) -> None:
    """A LiveKit `AgentSession` runs the omni_rt realtime model with in-process I/O: generate_reply plays
    audio, session.interrupt() stops it (no frame reaches the speaker after) and the framework truncates the
    reply to what was played, and a second reply plays to its end."""
    from livekit.agents import Agent, AgentSession

    from omni_rt.integrations.livekit_io import PlayoutAudioOutput, QueueAudioInput

    async with engine:
        model = RealtimeModel(engine, **REPLY)
        opened = sessions_of(model)
        heard: list[rtc.AudioFrame] = []
        first = asyncio.Event()
        speaker = PlayoutAudioOutput(on_frame=lambda f: (heard.append(f), first.set()))
        session = AgentSession(llm=model)
        session.input.audio, session.output.audio = QueueAudioInput(), speaker
        await session.start(Agent(instructions="You are brief."), record=False)

        handle = session.generate_reply(instructions="Greet the caller.")
        await asyncio.wait_for(first.wait(), WAIT_S)
        await session.interrupt()
        n_at_interrupt = len(heard)
        await asyncio.wait_for(handle.wait_for_playout(), WAIT_S)
        assert handle.interrupted and len(heard) == n_at_interrupt

        second = session.generate_reply()
        await asyncio.wait_for(second.wait_for_playout(), WAIT_S)
        assert not second.interrupted
        reply2 = sum(f.samples_per_channel for f in heard[n_at_interrupt:])
        assert 31 * 1920 < reply2 <= 32 * 1920

        (rt,) = opened
        said = [i for i in rt.chat_ctx.items if i.role == "assistant"]
        assert len(said) == 2 and said[0].interrupted and not said[1].interrupted
        assert len(said[0].text_content or "") < len(said[1].text_content)  # truncated to what was played
        # the framework's record of the interrupted reply (what it forwarded before the cut) is the model's
        kept = session.history.get_by_id(said[0].id)
        assert kept.interrupted and kept.text_content == said[0].text_content
        await session.aclose()
        await model.aclose()


async def test_unsupported_and_bad_calls_are_clear_errors(engine) -> None:
    """What omni_rt cannot do (video) and calls that make no sense are errors, events for the
    fire-and-forget calls; the session goes on."""
    async with engine:
        model = RealtimeModel(engine, **REPLY)
        rt = model.session(turn_detection_disabled=True)
        rec = Recorder(rt)
        rt.commit_audio()  # nothing was pushed
        rt.truncate(message_id="item_unknown", modalities=["audio"], audio_end_ms=0)
        rt.push_video(rtc.VideoFrame(2, 2, rtc.VideoBufferType.RGBA, bytes(16)))
        errors = await rec.wait("error", 3)
        assert all(isinstance(e.error, llm.RealtimeError) and e.recoverable for e in errors)
        ctx = rt.chat_ctx
        ctx.add_message(role="user", content="Hello.")
        ctx.add_message(role="user", content=[llm.ImageContent(image="https://example.com/a.png")])
        with pytest.raises(llm.RealtimeError, match="text messages"):
            await rt.update_chat_ctx(ctx)
        assert rt.chat_ctx.items == []  # nothing half-applied
        await rt.aclose()
        await model.aclose()


async def test_playout_output_plays_segments_in_turn_and_reports_how_far_an_interrupted_one_got() -> None:
    from omni_rt.integrations.livekit_io import PlayoutAudioOutput

    out = PlayoutAudioOutput()
    finished: list = []
    out.on("playback_finished", finished.append)
    frame = rtc.AudioFrame(np.zeros(2400, np.int16).tobytes(), 24000, 1, 2400)  # 100 ms
    await out.capture_frame(frame)
    out.flush()
    for _ in range(2):  # a second segment, queued behind the first
        await out.capture_frame(frame)
    out.flush()
    last = await asyncio.wait_for(out.wait_for_playout(), WAIT_S)
    assert [e.interrupted for e in finished] == [False, False]
    assert [e.playback_position for e in finished] == pytest.approx([0.1, 0.2], abs=1e-3)
    assert last is finished[-1]
    await out.capture_frame(frame)
    out.clear_buffer()  # stopped at once: it reports what had played, not what it held
    assert finished[-1].interrupted and finished[-1].playback_position < 0.1
    assert await asyncio.wait_for(out.wait_for_playout(), WAIT_S) is finished[-1]


async def test_a_cancelled_generate_reply_is_dropped_and_keeps_the_turn_for_the_next(engine) -> None:
    """The framework cancels a generate_reply future whose speech was interrupted before the reply came
    (as OpenAI's plugin then cancels the response): no reply is made for it, the next reply does not wait
    behind one nobody will play, and the committed speech is what the next reply answers."""
    async with engine:
        model = RealtimeModel(engine, **REPLY)
        rt = model.session(turn_detection_disabled=True)
        rec = Recorder(rt)
        say_and_commit(rt)
        dropped = rt.generate_reply()
        dropped.cancel()
        created = await asyncio.wait_for(rt.generate_reply(), WAIT_S)
        assert [f async for f in (await message(created)).audio_stream]
        await rec.wait("metrics_collected")
        assert len(rec.of("generation_created")) == 1
        items = rt.chat_ctx.items
        assert [i.role for i in items] == ["user", "assistant"]  # the speech, answered once
        assert isinstance(items[0].content[0], llm.AudioContent)
        await rt.aclose()
        await model.aclose()


async def test_closing_fails_the_replies_still_owed_and_later_ones(engine) -> None:
    """aclose() with a reply running and another queued behind it: the queued generate_reply future fails
    with a RealtimeError (as OpenAI's plugin fails its pending ones) instead of never resolving; a
    generate_reply after the close fails at once."""
    async with engine:
        model = RealtimeModel(engine, **REPLY)
        rt = model.session(turn_detection_disabled=True)
        running = await asyncio.wait_for(rt.generate_reply(instructions="Say hello."), WAIT_S)
        queued = rt.generate_reply(instructions="Say goodbye.")
        await rt.aclose()

        async def drain() -> list:
            return [f async for f in (await message(running)).audio_stream]

        await asyncio.wait_for(
            drain(), 10
        )  # the running reply's streams end: nothing waits on a closed session
        with pytest.raises(llm.RealtimeError, match="closed"):
            await asyncio.wait_for(queued, 10)
        with pytest.raises(llm.RealtimeError, match="closed"):
            await asyncio.wait_for(rt.generate_reply(), 10)
        await model.aclose()


async def test_agent_session_with_manual_turns_and_stereo_input(engine, caplog) -> None:
    """`QueueAudioInput` hands the session mono frames, as a room's input does (a sound card's stereo
    capture pushed as is stopped the framework's own VAD task); a framework-driven turn
    (`commit_user_turn`) is answered; the agent's chat context holds the turn, and a message the agent adds
    to it reaches the model; the framework logs no error."""
    from livekit.agents import Agent, AgentSession

    from omni_rt.integrations.livekit_io import PlayoutAudioOutput, QueueAudioInput

    pcm, rate = spoken("Good morning to you")
    caplog.set_level(logging.ERROR, logger="livekit.agents")
    async with engine:
        model = RealtimeModel(engine, **REPLY)
        opened = sessions_of(model)
        mic = QueueAudioInput()
        session = AgentSession(llm=model, turn_handling={"turn_detection": "manual"})
        session.input.audio, session.output.audio = mic, PlayoutAudioOutput()
        await session.start(Agent(instructions="You are brief."), record=False)
        frames = room_frames(np.concatenate([pcm, silence(0.3, rate)]), rate)  # 48 kHz stereo
        for frame in frames:
            mic.push(frame)
        (rt,) = opened
        pushed_ms = len(frames) * 10
        await asyncio.wait_for(until(lambda: rt._buffer.duration_ms >= pushed_ms - 10), WAIT_S)
        session.commit_user_turn()
        await asyncio.wait_for(until(lambda: session.current_speech is not None), WAIT_S)
        await asyncio.wait_for(session.current_speech.wait_for_playout(), WAIT_S)
        assert [i.role for i in rt.chat_ctx.items] == ["user", "assistant"]
        # the agent's own chat context holds the spoken turn too (announced as a remote item, as OpenAI's
        # plugin announces the server's), so the agent can add to it: Agent.update_chat_ctx
        agent = session.current_agent
        assert [i.id for i in agent.chat_ctx.items if i.type == "message"] == [
            i.id for i in rt.chat_ctx.items
        ]
        ctx = agent.chat_ctx.copy()
        ctx.add_message(role="user", content="My name is Ada.")
        await agent.update_chat_ctx(ctx)
        await asyncio.wait_for(session.generate_reply().wait_for_playout(), WAIT_S)
        ada = engine.tokenizer.encode("My name is Ada.")
        conversation = rt.omni_session.conversation
        assert any(conversation[i : i + len(ada)] == ada for i in range(len(conversation)))
        await session.aclose()
        await model.aclose()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_queue_input_downmixes_to_mono() -> None:
    from omni_rt.integrations.livekit_io import QueueAudioInput

    mic = QueueAudioInput()
    left, right = np.array([100, -200, 300], np.int16), np.array([300, 200, -100], np.int16)
    mic.push(rtc.AudioFrame(np.stack([left, right], 1).tobytes(), 48000, 2, 3))
    frame = asyncio.run(mic.__anext__())
    assert (frame.num_channels, frame.sample_rate, frame.samples_per_channel) == (1, 48000, 3)
    assert np.frombuffer(frame.data, np.int16).tolist() == [200, 0, 100]


async def until(condition) -> None:
    """Wait (one loop turn at a time) until `condition()` holds; the caller bounds it."""
    while not condition():
        await asyncio.sleep(0.01)


AUDIO_START = 151669  # <|audio_start|>: a spoken turn in the model's conversation


async def test_a_reply_refused_as_too_long_keeps_the_users_speech_for_the_next(engine) -> None:
    """generate_reply with instructions too long for the context: a clear error, and the user's committed
    speech, which the model never heard, is what the next reply answers."""
    async with engine:
        model = RealtimeModel(engine, **REPLY)
        rt = model.session(turn_detection_disabled=True)
        rec = Recorder(rt)
        say_and_commit(rt)
        await asyncio.wait_for(rt.generate_reply(instructions="Be brief. " * 20000), WAIT_S)
        (error,) = await rec.wait("error")
        assert "context" in str(error.error) and error.recoverable
        assert AUDIO_START not in rt.omni_session.conversation
        created = await asyncio.wait_for(rt.generate_reply(), WAIT_S)
        assert [f async for f in (await message(created)).audio_stream]
        assert AUDIO_START in rt.omni_session.conversation
        await rt.aclose()
        await model.aclose()


async def test_a_replys_instructions_come_before_a_text_turn_as_before_a_spoken_one(engine) -> None:
    """generate_reply(instructions=) is a system turn before the user turn, spoken or text (the docs): with
    a text message from the chat context they came after it."""
    async with engine:
        model = RealtimeModel(engine, **REPLY)
        rt = model.session(turn_detection_disabled=True)
        ctx = rt.chat_ctx
        ctx.add_message(role="user", content="Hello.")
        await rt.update_chat_ctx(ctx)
        created = await asyncio.wait_for(rt.generate_reply(instructions="In French."), WAIT_S)
        assert [f async for f in (await message(created)).audio_stream]
        said = engine.tokenizer.chat_prompt([("system", "In French."), ("user", "Hello.")])
        assert holds(rt.omni_session.conversation, said)
        await rt.aclose()
        await model.aclose()


async def test_a_session_opened_with_no_free_slot_opens_at_the_next_reply(engine) -> None:
    """Every engine slot taken when the realtime session opened: its omni_rt session failed to open, and
    every reply after that failed with the same error, even once slots were free (the failed open was
    kept). A reply then is a clear error; the next one, with a slot free, opens the session and is made."""
    from omni_rt.errors import SessionLimitError

    async with engine:
        model = RealtimeModel(engine, **REPLY)
        taken = []
        with pytest.raises(SessionLimitError):
            while True:
                taken.append(engine.session(voice="ethan"))
        rt = model.session(turn_detection_disabled=True)
        say_and_commit(rt)
        with pytest.raises(llm.RealtimeError, match="session"):
            await asyncio.wait_for(rt.generate_reply(), WAIT_S)
        for s in taken:
            await s.close()
        created = await asyncio.wait_for(rt.generate_reply(), WAIT_S)
        assert [f async for f in (await message(created)).audio_stream]
        assert AUDIO_START in rt.omni_session.conversation  # the speech committed before is answered
        await rt.aclose()
        await model.aclose()


async def test_words_refused_twice_are_dropped_not_kept_for_every_reply(engine) -> None:
    """A user message too long for the context was kept for the next reply each time it was refused, so
    every reply after it failed. Kept once: refused again, it is dropped, and the words beside it are
    answered."""
    async with engine:
        model = RealtimeModel(engine, **REPLY)
        rt = model.session(turn_detection_disabled=True)
        rec = Recorder(rt)
        for n, text in enumerate(("Hello. " * 20000, "My name is Ada.", "Thanks.")):
            ctx = rt.chat_ctx
            ctx.add_message(role="user", content=text)
            await rt.update_chat_ctx(ctx)
            created = await asyncio.wait_for(rt.generate_reply(), WAIT_S)
            if n < 2:
                assert "context" in str((await rec.wait("error", n + 1))[-1].error)
        assert [f async for f in (await message(created)).audio_stream]
        tok = engine.tokenizer
        said = tok.chat_prompt([("user", "My name is Ada."), ("user", "Thanks.")])[:-3]
        assert holds(rt.omni_session.conversation, said)
        assert not holds(rt.omni_session.conversation, tok.encode("Hello. " * 4))
        await rt.aclose()
        await model.aclose()


async def test_an_agent_handoff_gives_the_new_agent_its_own_conversation(engine, caplog) -> None:
    """`session.update_agent(...)`: omni_rt cannot delete what its model heard, so it says its chat context
    is not mutable and the framework opens a new session for a new agent with another context (instead of
    asking the old one to forget, an error in its logs); handing the history on keeps the session."""
    from livekit.agents import Agent, AgentSession

    from omni_rt.integrations.livekit_io import PlayoutAudioOutput, QueueAudioInput

    caplog.set_level(logging.ERROR, logger="livekit.agents")
    async with engine:
        model = RealtimeModel(engine, **REPLY)
        opened = sessions_of(model)
        session = AgentSession(llm=model)
        session.input.audio, session.output.audio = QueueAudioInput(), PlayoutAudioOutput()
        await session.start(Agent(instructions="You are a receptionist."), record=False)
        await asyncio.wait_for(session.generate_reply(instructions="Greet.").wait_for_playout(), WAIT_S)

        billing = Agent(instructions="You are a billing agent.")
        session.update_agent(billing)
        # the handoff's own task (wait_for_idle() can return on the old activity, before the swap)
        await asyncio.wait_for(session._update_activity_atask, WAIT_S)
        await asyncio.wait_for(session.generate_reply().wait_for_playout(), WAIT_S)
        receptionist, rt = opened
        assert receptionist._closed and rt.omni_session.settings.instructions == "You are a billing agent."
        assert [i.role for i in rt.chat_ctx.items] == ["assistant"]  # its own reply only

        support = Agent(instructions="You are a support agent.", chat_ctx=billing.chat_ctx)
        session.update_agent(support)
        await asyncio.wait_for(session._update_activity_atask, WAIT_S)
        await asyncio.wait_for(session.generate_reply().wait_for_playout(), WAIT_S)
        assert len(opened) == 2 and [i.role for i in rt.chat_ctx.items] == ["assistant", "assistant"]
        await session.aclose()
        await model.aclose()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_updates_during_a_reply_do_not_wait_for_it(engine) -> None:
    """update_instructions and update_chat_ctx while a reply is being made return at once (they waited for
    the whole reply to be generated) and reach the next reply."""
    async with engine:
        model = RealtimeModel(engine, max_output_tokens=400, max_audio_frames=300, ignore_eos=True)
        rt = model.session(turn_detection_disabled=True)
        rec = Recorder(rt)
        await asyncio.wait_for(rt.generate_reply(instructions="Talk."), WAIT_S)
        await rt.update_instructions("Speak slowly.")
        ctx = rt.chat_ctx
        ctx.add_message(role="user", content="My name is Ada.")
        await rt.update_chat_ctx(ctx)
        assert rec.of("metrics_collected") == []  # the reply is still being made
        rt.interrupt()
        created = await asyncio.wait_for(rt.generate_reply(), WAIT_S)
        rt.interrupt()
        await rec.wait("metrics_collected", 2)
        assert created.response_id
        tok, conversation = engine.tokenizer, rt.omni_session.conversation
        for text in ("Speak slowly.", "My name is Ada."):
            ids = tok.encode(text)
            assert any(conversation[i : i + len(ids)] == ids for i in range(len(conversation))), text
        await rt.aclose()
        await model.aclose()


def holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids)))


def tool_call(tok, name: str, arguments: str) -> list[int]:
    """The Thinker's ids of one call, between the template's special tokens."""
    return [TOOL_CALL, *tok.encode(f'{{"name": "{name}", "arguments": {arguments}}}'), TOOL_CALL_END]


async def test_an_agent_calls_a_function_tool_and_answers_with_its_result(caplog) -> None:
    """An `Agent` with a `@function_tool`, on a scripted Thinker: the tools are in the system prompt; the
    reply's <tool_call> becomes an `llm.FunctionCall` the framework runs with the parsed arguments (never
    spoken); its result goes back through update_chat_ctx as the template's <tool_response>, and the
    framework's next reply answers it. A tool that raises is answered as the framework answers it (an
    error output), and the conversation goes on."""
    from livekit.agents import Agent, AgentSession

    from omni_rt.integrations.livekit_io import PlayoutAudioOutput, QueueAudioInput
    from omni_rt.model.config import preset
    from omni_rt.tokenizer import Tokenizer

    tok = Tokenizer.tiny(preset("tiny").ids)  # the scripted engine's
    asked: list[str] = []

    @llm.function_tool
    async def lookup(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        if city == "Atlantis":
            raise RuntimeError("no such city")
        return f"sunny in {city}"

    engine = scripted_engine(
        tok.encode("Let me check.") + tool_call(tok, "lookup", '{"city": "Paris"}'),
        tok.encode("It is sunny."),
        tool_call(tok, "lookup", '{"city": "Atlantis"}'),
        tok.encode("I could not find it."),
    )
    caplog.set_level(logging.ERROR, logger="livekit.agents")
    async with engine:
        model = RealtimeModel(engine)
        opened = sessions_of(model)
        session = AgentSession(llm=model)
        session.input.audio, session.output.audio = QueueAudioInput(), PlayoutAudioOutput()
        await session.start(Agent(instructions="You are brief.", tools=[lookup]), record=False)
        (rt,) = opened
        rec = Recorder(rt)

        result = await asyncio.wait_for(session.run(user_input="Weather in Paris?"), WAIT_S)
        assert asked == ["Paris"]
        events = result.events
        # the lead-in, as far as the voice got before the call began (the Thinker runs ahead of it)
        if events[0].type == "message":
            assert "Let me check.".startswith(events[0].item.text_content), events[0].item.text_content
            events = events[1:]
        assert [e.type for e in events] == ["function_call", "function_call_output", "message"]
        call, output, answer = (e.item for e in events)
        assert (call.name, json.loads(call.arguments)) == ("lookup", {"city": "Paris"})
        assert output.call_id == call.call_id and output.output == "sunny in Paris" and not output.is_error
        assert answer.text_content == "It is sunny."
        # the first reply's prompt: the tools in the session's system turn, as the template writes them
        system = engine.tokenizer.last_turn(engine.prompts[0], "system")
        assert system.startswith("You are brief.\n\n# Tools") and '"name": "lookup"' in system
        # the second's: the result as the template's tool response, after the call the model made
        assert holds(engine.prompts[1], tok.encode(tool_response("sunny in Paris")))
        said = rt.chat_ctx.items
        assert [i.type for i in said] == [
            "message",
            "message",
            "function_call",
            "function_call_output",
            "message",
        ]
        # nothing of the call was spoken or written: the first reply's transcript is at most its lead-in
        assert (
            "Let me check.".startswith(said[1].text_content or "") and said[4].text_content == "It is sunny."
        )

        result = await asyncio.wait_for(session.run(user_input="And in Atlantis?"), WAIT_S)
        assert asked == ["Paris", "Atlantis"]
        outputs = [e.item for e in result.events if e.type == "function_call_output"]
        assert len(outputs) == 1 and outputs[0].is_error
        assert holds(engine.prompts[3], tok.encode(tool_response(outputs[0].output)))
        assert result.events[-1].item.text_content == "I could not find it."
        assert rec.of("error") == []
        await session.aclose()
        await model.aclose()
    # the framework logs the tool's exception, as it does with any model; nothing else went wrong
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["exception occurred while executing tool"]


async def test_bad_tool_calls_and_outputs_are_clear_errors_and_new_tools_a_system_turn() -> None:
    """A malformed call (a tool the agent does not have) is an error event, and nothing is run or spoken;
    an output for a call the model never made, a second output for one, a call it never made handed
    back, a provider's own tool or a reply's own tools are `RealtimeError`s, nothing half-applied. Tools changed once the conversation began are a
    system turn before the next reply; tool_choice "none" takes them out of it."""
    from omni_rt.model.config import preset
    from omni_rt.tokenizer import Tokenizer

    @llm.function_tool
    async def lookup(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    @llm.function_tool
    async def book(city: str) -> str:
        """Book a trip to a city."""
        return "booked"

    tok = Tokenizer.tiny(preset("tiny").ids)
    engine = scripted_engine(
        tool_call(tok, "rm_rf", "{}"), tool_call(tok, "lookup", '{"city": "Oslo"}'), tok.encode("Fine.")
    )
    async with engine:
        model = RealtimeModel(engine, instructions="Be brief.")
        rt = model.session(turn_detection_disabled=True)
        rec = Recorder(rt)
        await rt.update_tools([lookup])
        assert list(rt.tools.function_tools) == ["lookup"]
        with pytest.raises(llm.RealtimeError, match="function tools only"):
            await rt.update_tools([lookup, llm.ProviderTool(id="web_search")])  # a provider's hosted tool
        assert list(rt.tools.function_tools) == ["lookup"]  # as they were
        with pytest.raises(llm.RealtimeError, match="update_tools"):
            await rt.generate_reply(tools=[book])  # a reply's own tools: the system prompt is the session's

        created = await asyncio.wait_for(rt.generate_reply(), WAIT_S)
        assert [f async for f in created.function_stream] == []  # nothing to run
        assert [f async for f in (await message(created)).audio_stream] == []  # nor anything said
        (error,) = await rec.wait("error")
        assert "malformed tool call" in str(error.error) and "rm_rf" in str(error.error)

        created = await asyncio.wait_for(rt.generate_reply(), WAIT_S)
        (call,) = [f async for f in created.function_stream]
        assert (call.name, call.arguments) == ("lookup", '{"city": "Oslo"}')
        await rec.wait("metrics_collected", 2)
        assert rt.chat_ctx.items[-1].id == call.id  # in the chat context, as the framework expects it

        for item, match in (
            (llm.FunctionCallOutput(call_id="call_other", output="x", is_error=False), "did not make"),
            (llm.FunctionCall(call_id="call_other", name="lookup", arguments="{}"), "made"),
        ):
            ctx = rt.chat_ctx
            ctx.add_message(role="user", content="Thanks.")
            ctx.insert(item)
            with pytest.raises(llm.RealtimeError, match=match):
                await rt.update_chat_ctx(ctx)
            assert rt.chat_ctx.items[-1].id == call.id  # nothing half-applied
        ctx = rt.chat_ctx
        ctx.insert(llm.FunctionCallOutput(call_id=call.call_id, output="cold", is_error=False))
        await rt.update_chat_ctx(ctx)
        again = rt.chat_ctx
        again.insert(llm.FunctionCallOutput(call_id=call.call_id, output="warm", is_error=False))
        with pytest.raises(llm.RealtimeError, match="second"):
            await rt.update_chat_ctx(again)

        await rt.update_tools([lookup, book])
        created = await asyncio.wait_for(rt.generate_reply(), WAIT_S)
        assert [f async for f in (await message(created)).audio_stream]
        system = tok.last_turn(engine.prompts[-1], "system")
        assert '"name": "lookup"' in system and '"name": "book"' in system
        assert holds(engine.prompts[-1], tok.encode(tool_response("cold")))

        rt.update_options(tool_choice="none")
        await asyncio.wait_for(rt.generate_reply(), WAIT_S)
        await rec.wait("metrics_collected", 4)
        assert tok.last_turn(engine.prompts[-1], "system") == "Be brief."  # without the tools
        assert len(rec.of("error")) == 1
        await rt.aclose()
        await model.aclose()


def test_a_malformed_tool_choice_is_a_realtime_error_and_changes_nothing():
    # {"function": "lookup"} raised AttributeError out of update_options; now livekit's RealtimeError
    from omni_rt.integrations.livekit_tools import SessionTools
    from omni_rt.tools import Function

    tools = SessionTools()
    tools.set_choice({"type": "function", "function": {"name": "lookup"}})
    for bad in ({"type": "function", "function": "lookup"}, "sometimes", {"type": "function"}):
        with pytest.raises(llm.RealtimeError, match="unknown tool_choice"):
            tools.set_choice(bad)
        assert tools.choice == Function("lookup")
    tools.set_choice(None)
    assert tools.choice == "auto"
