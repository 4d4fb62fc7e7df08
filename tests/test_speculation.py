"""Encoding while the user speaks and speculative replies, on the tiny model through the real Session:
a turn encoded as it arrived answers exactly as the same turn encoded whole; a speculative reply that
is dropped leaves no trace; a released one is the reply a plain respond() gives."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import omni_rt
from omni_rt.errors import InvalidRequestError

SR = 16000
GREEDY = omni_rt.Sampling.greedy(seed=7)
# The text ends well before the audio does: a reply's text stops when its audio does, so text capped
# beyond its audio would end at whichever token the Thinker had reached by then (a race the 4-group
# tiny's faster Talker lost now and then: 5 tokens against 6).
LIMITS = {"max_output_tokens": 4, "max_audio_frames": 8}


def speechlike(seconds: float, seed: int) -> np.ndarray:
    """Voiced-sounding audio: a gliding harmonic tone under a syllable-rate envelope, with breath noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SR
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    return (0.2 * env * voice + 0.01 * rng.standard_normal(len(t))).astype(np.float32)


@pytest.fixture(scope="module")
def engine():
    return omni_rt.Engine.load("tiny", deterministic=True)


def live_clip(session, audio: np.ndarray, chunk: int = 320):
    live = session.live_speech()
    for i in range(0, len(audio), chunk):  # 20 ms pieces, as a microphone sends them
        live.push(audio[i : i + chunk])
    return live


def reply_ids(events) -> list[int]:
    return [t for e in events if e.type == "response.output_text.delta" for t in e.token_ids]


async def collect(stream) -> list:
    return [ev async for ev in stream]


def shape(events) -> dict:
    """What a reply says, without its ids and timings (the Thinker's text and the Talker's transcript
    interleave as the threads run; each on its own is exact)."""
    done = events[-1]
    return {
        "ends": (events[0].type, done.type, done.status, done.usage.output_tokens, done.usage.audio_frames),
        "text": reply_ids(events),
        "transcript": "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta"),
        "audio": b"".join(e.pcm.tobytes() for e in events if e.type == "response.output_audio.delta"),
        "types": sorted({e.type for e in events}),
    }


async def test_a_turn_encoded_while_spoken_answers_as_the_whole_turn(engine):
    q = speechlike(2.6, seed=1)
    async with engine:
        encoder = engine.model.thinker.audio_tower
        async with engine.session(sampling=GREEDY) as whole:
            plain = await collect(whole.respond(audio=q, **LIMITS))
            plain_conv = list(whole.conversation)
        async with engine.session(sampling=GREEDY) as s:
            live = live_clip(s, q)
            clip = live.clip()
            feats, tokens = await clip.encoding()
            assert torch_close(feats, _whole_features(q)) and tokens.shape[0] > 0
            calls = []  # the Thinker's prefill must not run the encoder: the clip's tokens are used
            handle = encoder.register_forward_hook(lambda *a: calls.append(1))
            try:
                streamed = await collect(s.respond(audio=clip, **LIMITS))
            finally:
                handle.remove()
            assert calls == []
            assert reply_ids(streamed) == reply_ids(plain) and reply_ids(plain)
            assert shape(streamed) == shape(plain)
            assert s.conversation == plain_conv


def _whole_features(audio):
    from omni_rt.audio.features import log_mel

    return log_mel(audio)


def torch_close(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape) and float((a - b).abs().max()) < 1e-5


async def test_bad_live_audio_is_refused_at_once_and_loses_nothing(engine):
    async with engine, engine.session(sampling=GREEDY) as s:
        live = s.live_speech()
        live.push(speechlike(0.5, seed=2))
        for bad in (
            np.zeros((2, 160), np.float32),
            np.array([np.nan] * 160, np.float32),
            np.zeros(160, np.int16),
        ):
            with pytest.raises(InvalidRequestError):
                live.push(bad)
        assert live.samples == 8000  # what came before is kept
        done = (await collect(s.respond(audio=live.clip(), **LIMITS)))[-1]
        assert done.status == "completed"


async def until_held_work(spec, what) -> None:
    """Wait (on the loop) until the held response's pipeline has got as far as `what` says."""
    for _ in range(3000):
        resp = spec._hold.resp
        if resp is not None and what(resp):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the speculative response did not get there")


async def test_a_dropped_speculation_leaves_no_trace(engine):
    first, pause, more = speechlike(1.5, seed=3), speechlike(0.2, seed=4) * 0.0, speechlike(1.0, seed=5)
    turn = np.concatenate([first, pause, more])
    async with engine:
        async with engine.session(sampling=GREEDY) as plain:
            await plain.run("hi", **LIMITS)
            before = list(plain.conversation)
            want = await collect(plain.respond(audio=turn, **LIMITS))
            want_conv = list(plain.conversation)
        async with engine.session(sampling=GREEDY) as s:
            await s.run("hi", **LIMITS)
            assert s.conversation == before
            live = live_clip(s, np.concatenate([first, pause]))
            spec = s.speculate(audio=live.clip(), **LIMITS)
            # it prefilled and made audio, in the caches of this session's slot
            await until_held_work(spec, lambda r: r.req.frames > 0)
            await spec.drop()  # the user went on talking
            assert s.conversation == before and spec._queue.qsize() > 0  # its events were never read
            with pytest.raises(RuntimeError):
                spec.release()
            for i in range(0, len(more), 320):
                live.push(more[i : i + 320])
            got = await collect(s.respond(audio=live.clip(), **LIMITS))
            assert shape(got) == shape(want) and reply_ids(want)
            assert s.conversation == want_conv


@pytest.mark.parametrize("when", ["at_once", "after_it_finished"])
async def test_a_released_speculation_is_the_plain_reply(engine, when):
    q = speechlike(1.8, seed=6)
    async with engine:
        async with engine.session(sampling=GREEDY) as plain:
            want = await collect(plain.respond(audio=q, **LIMITS))
            want_conv = list(plain.conversation)
            again = await collect(plain.respond("and?", **LIMITS))
        async with engine.session(sampling=GREEDY) as s:
            spec = s.speculate(audio=live_clip(s, q).clip(), **LIMITS)
            if when == "after_it_finished":  # done while held: its turn commits only at release
                await until_held_work(spec, lambda r: r.done.is_set())
                assert s.conversation == []
            got = await collect(spec.release())
            assert not spec.failed and shape(got) == shape(want)
            assert got[-1].metrics.held_ms is not None
            assert s.conversation == want_conv
            assert shape(await collect(s.respond("and?", **LIMITS))) == shape(again)


async def test_only_one_speculation_and_no_respond_while_it_is_held(engine):
    async with engine, engine.session(sampling=GREEDY) as s:
        spec = s.speculate(audio=speechlike(1.0, seed=8), **LIMITS)
        with pytest.raises(InvalidRequestError):
            s.speculate("again")
        events = await collect(s.respond("meanwhile", **LIMITS))
        assert events[-1].status == "failed" and "speculative" in events[1].error.message
        await spec.drop()
        assert s.conversation == []
        assert (await s.run("now", **LIMITS)).status == "completed"
