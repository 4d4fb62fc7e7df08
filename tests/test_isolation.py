"""Many conversations on one engine (tiny, CPU; issue 10): eight staggered conversations each get exactly
what they get alone, one sending an invalid request fails alone, and the ninth session beyond a ceiling
of eight gets the documented error at once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import omni_rt
from omni_rt.errors import SessionLimitError
from omni_rt.pipeline.runners import build_runners

TEXTS = [
    "Hello there.",
    "What is the weather like?",
    "Tell me a story.",
    "One more question, please.",
    "Why is the sea blue?",
    "Count to three.",
    "Say something nice.",
    "And the last one.",
]
KW = dict(max_output_tokens=6, max_audio_frames=8)


@pytest.fixture(scope="module")
def tiny():
    return omni_rt.Engine.load("tiny")


def engine_of(tiny, sessions: int) -> omni_rt.Engine:
    settings = omni_rt.EngineSettings(max_sessions=sessions, deterministic=True)
    return omni_rt.Engine(
        tiny.cfg, tiny.tokenizer, lambda st: build_runners(tiny.model, st), settings, model=tiny.model
    )


def text_and_pcm(events) -> tuple[list[int], np.ndarray]:
    tokens = [t for e in events if e.type == "response.output_text.delta" for t in e.token_ids]
    pcm = [e.pcm for e in events if e.type == "response.output_audio.delta"]
    return tokens, np.concatenate(pcm) if pcm else np.zeros(0, np.int16)


async def test_eight_staggered_conversations_each_get_what_they_get_alone(tiny):
    sampling = [omni_rt.Sampling(seed=100 + k) for k in range(8)]

    alone = []
    engine = engine_of(tiny, 1)
    async with engine:
        for k, text in enumerate(TEXTS):
            async with engine.session() as s:
                alone.append(
                    text_and_pcm([ev async for ev in s.respond(text=text, sampling=sampling[k], **KW)])
                )

    engine = engine_of(tiny, 8)
    started = [asyncio.Event() for _ in TEXTS]  # conversation k + 1 starts at k's first audio

    async def conversation(k: int, s) -> list:
        if k:
            await started[k - 1].wait()
        if k == 3:  # first an invalid request: it fails at once, and fails alone
            bad = [ev async for ev in s.respond(input_ids=[tiny.cfg.thinker.vocab_size + 5], **KW)]
            assert bad[-1].type == "response.done" and bad[-1].status == "failed"
            assert bad[-1].error.code == "InvalidRequestError"
        events = []
        async for ev in s.respond(text=TEXTS[k], sampling=sampling[k], **KW):
            events.append(ev)
            if ev.type == "response.output_audio.delta":
                started[k].set()
        started[k].set()  # a reply without audio must not hold the others back
        return events

    async with engine:
        sessions = [engine.session() for _ in TEXTS]
        try:
            with pytest.raises(SessionLimitError, match="all 8 session slots are in use") as refused:
                engine.session()  # the ninth: refused at once, nothing queued
            assert refused.value.code == "session_limit" and engine.capacity.waiting == 0
            together = await asyncio.gather(*(conversation(k, s) for k, s in enumerate(sessions)))
        finally:
            for s in sessions:
                await s.close()
    for k, events in enumerate(together):
        assert events[-1].type == "response.done" and events[-1].status == "completed", k
        tokens, pcm = text_and_pcm(events)
        assert tokens == alone[k][0], f"conversation {k}: text differs from alone"
        assert np.array_equal(pcm, alone[k][1]), f"conversation {k}: PCM differs from alone"
    assert any(len(pcm) for _, pcm in alone), "the replies must carry audio for the test to mean anything"
