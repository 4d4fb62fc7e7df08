"""The user's transcript in LiveKit Agents: a spoken turn is transcribed by the Thinker after its reply's
first audio and reaches `AgentSession` as `user_input_transcribed` and the agent's chat context; a
transcription that cannot run is a recoverable `error` event while the reply plays on. The tiny preset's
random weights make the text noise: the mechanism is the real one."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from integrations_support import silence, spoken, tiny_engine
from livekit.agents import llm
from test_integrations_livekit import (
    REPLY,
    WAIT_S,
    Recorder,
    message,
    room_frames,
    say_and_commit,
    sessions_of,
)

from omni_rt.errors import SessionLimitError
from omni_rt.integrations.livekit import RealtimeModel


@pytest.fixture
def engine():
    return tiny_engine()


def watch_transcriptions(engine, monkeypatch, rts: list) -> list[int]:
    """Each transcription session the engine opens (a session with no settings: a realtime session always
    has its voice) is recorded as the audio, in samples, that the replies had handed to the framework then."""
    opened: list[int] = []
    session_of = engine.session

    def session(**kwargs):
        if not kwargs:
            opened.append(sum(g.samples for rt in rts for g in rt._generations.values()))
        return session_of(**kwargs)

    monkeypatch.setattr(engine, "session", session)
    return opened


async def test_agent_session_gets_the_users_transcript_after_the_replys_first_audio(
    engine, monkeypatch, caplog
) -> None:
    """omni_rt's VAD cuts the turn and replies; once the reply's audio has started, the turn is transcribed:
    `user_input_transcribed` fires (interim, then final) for the user item the adapter announced, and the
    agent's chat context holds the text in that item; the framework logs no error."""
    from livekit.agents import Agent, AgentSession

    from omni_rt.integrations.livekit_io import PlayoutAudioOutput, QueueAudioInput

    pcm, rate = spoken("Good morning to you")
    caplog.set_level(logging.ERROR, logger="livekit.agents")
    async with engine:
        model = RealtimeModel(engine, **REPLY)
        assert model.capabilities.user_transcription  # the framework then takes the model's transcript
        rts = sessions_of(model)
        opened = watch_transcriptions(engine, monkeypatch, rts)
        mic = QueueAudioInput()
        session = AgentSession(llm=model)
        session.input.audio, session.output.audio = mic, PlayoutAudioOutput()
        final = asyncio.Event()
        heard: list = []
        session.on("user_input_transcribed", lambda ev: (heard.append(ev), ev.is_final and final.set()))
        await session.start(Agent(instructions="You are brief."), record=False)
        for frame in room_frames(np.concatenate([silence(0.3, rate), pcm, silence(1.2, rate)]), rate):
            mic.push(frame)
        await asyncio.wait_for(final.wait(), WAIT_S)

        (rt,) = rts
        user = next(i for i in rt.chat_ctx.items if i.role == "user")
        ev = heard[-1]
        assert ev.is_final and ev.item_id == user.id and [e for e in heard if e.is_final] == [ev]
        assert user.text_content == ev.transcript  # the adapter's own item holds the text too
        # the transcription ran alone, once, and only once the reply had handed audio to the framework
        assert len(opened) == 1 and opened[0] > 0, opened
        agent_item = session.current_agent.chat_ctx.get_by_id(user.id)
        assert agent_item is not None and agent_item.role == "user"
        assert agent_item.text_content == ev.transcript
        await session.aclose()
        await model.aclose()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_no_free_session_slot_is_a_recoverable_error_and_the_reply_plays_on(
    engine, monkeypatch
) -> None:
    """Every engine slot but the conversation's own is taken: the turn's transcription cannot run. That is
    an `error` event (recoverable, naming `session_limit`) after the reply's first audio; the reply plays to
    its end and no transcript is claimed. Off (`user_transcription=False`), nothing is transcribed."""
    async with engine:
        model = RealtimeModel(engine, **REPLY)
        rt = model.session(turn_detection_disabled=True)
        opened = watch_transcriptions(engine, monkeypatch, [rt])
        rec = Recorder(rt)
        transcripts: list = []
        rt.on("input_audio_transcription_completed", transcripts.append)
        await rt._ready()
        taken = []
        with pytest.raises(SessionLimitError):
            while True:
                taken.append(engine.session(voice="ethan"))
        try:
            say_and_commit(rt)
            created = await asyncio.wait_for(rt.generate_reply(), WAIT_S)
            frames = [f async for f in (await message(created)).audio_stream]
            assert 31 * 1920 < sum(f.samples_per_channel for f in frames) <= 32 * 1920  # all of it
            (err,) = await rec.wait("error")
            assert isinstance(err, llm.RealtimeModelError) and err.recoverable
            assert "transcribe" in str(err.error) and "session_limit" in str(err.error)
            assert len(opened) == 1 and opened[0] > 0 and transcripts == []
        finally:
            for s in taken:
                await s.close()
        await rt.aclose()

        off = RealtimeModel(engine, **REPLY, user_transcription=False)
        assert not off.capabilities.user_transcription
        rt = off.session(turn_detection_disabled=True)
        opened.clear()
        say_and_commit(rt)
        created = await asyncio.wait_for(rt.generate_reply(), WAIT_S)
        assert [f async for f in (await message(created)).audio_stream]
        await rt.aclose()
        assert opened == []
