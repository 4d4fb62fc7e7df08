"""`PlayoutAudioOutput`, the in-process LiveKit sink: frames go out when due, a pause stops them and the
playback clock, and the framework's false-interruption resume (a reply paused by the user's noise, then
resumed) plays the whole reply. Short real-time segments (a few hundred ms): the clock is the real one."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest

pytest.importorskip("livekit.agents")

from integrations_support import scripted_engine  # noqa: E402
from livekit import rtc  # noqa: E402
from livekit.agents import Agent, AgentSession, stt, vad  # noqa: E402
from test_integrations_livekit import sessions_of, until  # noqa: E402

from omni_rt.integrations.livekit import RealtimeModel  # noqa: E402
from omni_rt.integrations.livekit_io import PlayoutAudioOutput, QueueAudioInput  # noqa: E402

FRAME_S = 0.02
WAIT_S = 10.0


def frame(i: int) -> rtc.AudioFrame:
    """20 ms at 24 kHz whose samples all say `i`: the order frames came out in is readable."""
    n = int(24000 * FRAME_S)
    return rtc.AudioFrame(np.full(n, i, np.int16).tobytes(), 24000, 1, n)


class Speaker:
    """What reaches the app: each frame's number and when it came (time.monotonic()); `wait(n)` returns
    once `n` frames came."""

    def __init__(self) -> None:
        self.got: list[tuple[int, float]] = []
        self.samples = 0
        self._changed = asyncio.Event()

    def __call__(self, f: rtc.AudioFrame) -> None:
        self.got.append((int(np.frombuffer(f.data, np.int16)[0]), time.monotonic()))
        self.samples += f.samples_per_channel
        self._changed.set()

    @property
    def numbers(self) -> list[int]:
        return [i for i, _ in self.got]

    async def wait(self, n: int) -> None:
        async def until() -> None:
            while len(self.got) < n:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(until(), WAIT_S)


def sink(lead: float = 0.0) -> tuple[PlayoutAudioOutput, Speaker, list, list]:
    """A sink, its speaker, and the playback_finished and playback_progressed events it emits."""
    speaker = Speaker()
    out = PlayoutAudioOutput(on_frame=speaker, lead=lead)
    finished: list = []
    progressed: list = []
    out.on("playback_finished", finished.append)
    out.on("playback_progressed", progressed.append)
    return out, speaker, finished, progressed


async def capture(out: PlayoutAudioOutput, numbers: range, flush: bool = True) -> float:
    """Capture one segment of those frames at once, as the framework forwards a fast model's audio; returns
    when it was captured (time.monotonic())."""
    t0 = time.monotonic()
    for i in numbers:
        await out.capture_frame(frame(i))
    if flush:
        out.flush()
    return t0


async def test_frames_go_out_when_due_in_order_and_segments_in_turn() -> None:
    """Captured at once, 0.2 s of audio in two segments goes out in real time: in order, no frame more than
    `lead` ahead of its time, the second segment's after the first's; each ends once played."""
    lead = 0.04
    out, speaker, finished, _ = sink(lead)
    t0 = await capture(out, range(6))
    await capture(out, range(6, 10))
    last = await asyncio.wait_for(out.wait_for_playout(), WAIT_S)
    elapsed = time.monotonic() - t0
    assert speaker.numbers == list(range(10))
    for i, t in speaker.got:
        assert t - t0 >= i * FRAME_S - lead - 1e-3, (i, t - t0)  # never ahead of its time by more
    assert speaker.got[-1][1] - t0 >= 0.18 - lead  # paced, not all at once
    assert [e.interrupted for e in finished] == [False, False] and last is finished[-1]
    assert [e.playback_position for e in finished] == pytest.approx([0.12, 0.08], abs=1e-6)
    assert elapsed >= 0.2 - 1e-3


async def pause_after(out: PlayoutAudioOutput, speaker: Speaker, n: int) -> tuple[int, float]:
    """Pause once `n` frames came out: (the frames out then, the position). With no lead, the frames out
    are the ones due: the last began before the playhead, the next one is not yet due."""
    await speaker.wait(n)
    out.pause()
    out_then, position = len(speaker.got), out.position
    assert out.paused and (out_then - 1) * FRAME_S <= position <= out_then * FRAME_S + 1e-3
    return out_then, position


async def test_pause_stops_the_frames_and_the_clock_and_resume_goes_on_from_there() -> None:
    out, speaker, finished, progressed = sink()
    t0 = await capture(out, range(10))
    n, position = await pause_after(out, speaker, 3)
    paused_at = time.monotonic()
    await asyncio.sleep(0.1)  # a stretch of pause: nothing may come in it
    assert len(speaker.got) == n and out.position == position and finished == []
    out.resume()
    pause = time.monotonic() - paused_at  # at most the time the clock stood still
    assert not out.paused
    await asyncio.wait_for(out.wait_for_playout(), WAIT_S)
    assert speaker.numbers == list(range(10))
    assert speaker.got[n][1] - t0 >= n * FRAME_S + pause  # the pause is not played time
    assert time.monotonic() - t0 >= 0.2 + pause
    assert finished[0].playback_position == pytest.approx(0.2) and not finished[0].interrupted
    # two runs, as the framework's recorder places them: before the pause and after it
    runs = [(p.offset, p.duration) for p in progressed]
    assert [o for o, _ in runs] == pytest.approx([0.0, position])
    assert sum(d for _, d in runs) == pytest.approx(0.2)
    assert progressed[1].started_at - progressed[0].started_at >= position + pause - 1e-3


async def test_a_clear_while_paused_reports_what_played_and_nothing_more_goes_out() -> None:
    out, speaker, finished, _ = sink()
    await capture(out, range(10))
    n, position = await pause_after(out, speaker, 3)
    await asyncio.sleep(0.05)
    out.clear_buffer()
    assert len(finished) == 1 and finished[0].interrupted
    assert finished[0].playback_position == position  # the paused time is not played time
    assert await asyncio.wait_for(out.wait_for_playout(), WAIT_S) is finished[0]
    out.resume()
    await asyncio.sleep(0.05)
    assert len(speaker.got) == n and out._timer is None  # dropped, and nothing left running


async def test_a_clear_after_a_pause_counts_the_audio_played_on_both_sides_of_it() -> None:
    """Played = the time since the first frame less the pause, bounded by clock reads around each call."""
    out, speaker, finished, _ = sink()
    t0 = await capture(out, range(20))
    t1 = time.monotonic()
    await speaker.wait(3)
    p0 = time.monotonic()
    await pause_after(out, speaker, 3)
    p1 = time.monotonic()
    await asyncio.sleep(0.05)
    r0 = time.monotonic()
    out.resume()
    r1 = time.monotonic()
    await speaker.wait(6)
    c0 = time.monotonic()
    out.clear_buffer()
    c1 = time.monotonic()
    n, ev = len(speaker.got), finished[0]
    assert ev.interrupted and c0 - t1 - (r1 - p0) <= ev.playback_position <= c1 - t0 - (r0 - p1)
    assert ev.playback_position >= (n - 1) * FRAME_S  # at least what went out, less the frame playing
    await capture(out, range(20, 22))  # the next reply starts at the playhead, not behind what was dropped
    await asyncio.wait_for(out.wait_for_playout(), WAIT_S)
    assert speaker.numbers[n:] == [20, 21] and finished[1].playback_position == pytest.approx(0.04)


async def test_a_flush_while_paused_ends_the_segment_only_after_resume_and_the_rest() -> None:
    out, speaker, finished, _ = sink()
    await capture(out, range(10), flush=False)
    n, position = await pause_after(out, speaker, 3)
    out.flush()
    await asyncio.sleep(0.25)  # longer than the whole segment: a paused one does not end
    assert finished == [] and len(speaker.got) == n
    resumed = time.monotonic()
    out.resume()
    ev = await asyncio.wait_for(out.wait_for_playout(), WAIT_S)
    assert time.monotonic() - resumed >= 0.2 - position
    assert not ev.interrupted and ev.playback_position == pytest.approx(0.2)
    assert speaker.numbers == list(range(10)) and out._timer is None


async def test_a_failing_on_frame_is_logged_and_the_audio_plays_on(caplog) -> None:
    heard: list[int] = []

    def play(f: rtc.AudioFrame) -> None:
        heard.append(int(np.frombuffer(f.data, np.int16)[0]))
        if len(heard) == 2:
            raise OSError("the sound card hiccuped")

    out = PlayoutAudioOutput(on_frame=play)
    caplog.set_level(logging.ERROR, logger="omni_rt.integrations")
    await capture(out, range(4))
    ev = await asyncio.wait_for(out.wait_for_playout(), WAIT_S)
    assert heard == [0, 1, 2, 3] and not ev.interrupted
    assert ["on_frame raised" in r.getMessage() for r in caplog.records] == [True]


# --- the framework's false interruption: a real AgentSession pauses the reply and resumes it ---------------


class ScriptedVAD(vad.VAD):
    """A VAD whose events the test sends (`say`), in the order it sends them: the user's noise, on cue."""

    def __init__(self) -> None:
        super().__init__(capabilities=vad.VADCapabilities(update_interval=0.032))
        self.streams: list[ScriptedVADStream] = []

    def stream(self) -> ScriptedVADStream:
        self.streams.append(ScriptedVADStream(self))
        return self.streams[-1]

    def say(self, kind: vad.VADEventType, speech_s: float, silence_s: float = 0.0) -> None:
        ev = vad.VADEvent(
            type=kind,
            samples_index=0,
            timestamp=time.time(),
            speech_duration=speech_s,
            silence_duration=silence_s,
            speaking=kind != vad.VADEventType.END_OF_SPEECH,
            raw_accumulated_speech=speech_s,
            raw_accumulated_silence=silence_s,
        )
        self.streams[-1]._event_ch.send_nowait(ev)


class ScriptedVADStream(vad.VADStream):
    async def _main_task(self) -> None:
        async for _ in self._input_ch:  # the session's audio: this VAD decides nothing from it
            pass


class DeafSTT(stt.STT):
    """An STT that hears no words: the user's sound was noise, so no turn is committed."""

    def __init__(self) -> None:
        super().__init__(capabilities=stt.STTCapabilities(streaming=True, interim_results=False))

    async def _recognize_impl(self, buffer, *, language=None, conn_options=None) -> stt.SpeechEvent:
        raise NotImplementedError


class Listener(Agent):
    async def stt_node(self, audio, model_settings):
        async for _ in audio:
            pass
        return
        yield  # an async generator that yields no transcript


async def test_an_agent_session_resumes_a_reply_paused_by_noise_and_plays_it_whole() -> None:
    """The framework pauses the agent's reply when the user makes a sound (the sink declared pause=False,
    so the reply was cut off instead), and resumes it once the sound proves no interruption (no words
    came): nothing plays while paused, all of the reply's audio reaches the speaker once, and the reply
    is not interrupted."""
    from omni_rt.model.config import preset
    from omni_rt.tokenizer import Tokenizer

    tok = Tokenizer.tiny(preset("tiny").ids)
    engine = scripted_engine(tok.encode("Hello there."))  # a codec frame a token: ~1 s of audio
    noise = ScriptedVAD()
    speaker = Speaker()
    out = PlayoutAudioOutput(on_frame=speaker)
    async with engine:
        model = RealtimeModel(engine, user_transcription=False)
        opened = sessions_of(model)
        session = AgentSession(
            llm=model,
            vad=noise,
            stt=DeafSTT(),
            aec_warmup_duration=None,  # the user can interrupt at once (by default not for the first 3 s)
            session_close_transcript_timeout=0.1,  # the deaf STT has no last words to wait for at close
            turn_handling={
                "turn_detection": "vad",
                "interruption": {"mode": "vad", "min_duration": 0.1, "false_interruption_timeout": 0.05},
            },
        )
        resumed = asyncio.get_running_loop().create_future()
        session.on(
            "agent_false_interruption",
            lambda ev: resumed.done() or resumed.set_result((ev, len(speaker.got))),  # heard by the resume
        )
        session.input.audio, session.output.audio = QueueAudioInput(), out
        await session.start(Listener(instructions="You are brief."), record=False)

        handle = session.generate_reply()
        await speaker.wait(3)
        assert session.agent_state == "speaking"
        noise.say(vad.VADEventType.START_OF_SPEECH, speech_s=0.05)
        noise.say(vad.VADEventType.INFERENCE_DONE, speech_s=0.2)
        await asyncio.wait_for(until(lambda: session.agent_state != "speaking"), WAIT_S)
        assert not handle.interrupted and out.paused  # held, not cut off
        heard_at_pause = len(speaker.got)
        noise.say(vad.VADEventType.END_OF_SPEECH, speech_s=0.2, silence_s=0.05)
        ev, heard_at_resume = await asyncio.wait_for(resumed, WAIT_S)
        assert ev.resumed and not out.paused and heard_at_resume == heard_at_pause
        await asyncio.wait_for(handle.wait_for_playout(), WAIT_S)
        assert not handle.interrupted and len(speaker.got) > heard_at_pause
        (rt,) = opened
        assert speaker.samples == sum(g.samples for g in rt._generations.values()) > 0  # all of it, once
        assert [i.role for i in rt.chat_ctx.items] == ["assistant"] and not rt.chat_ctx.items[0].interrupted
        await session.aclose()
        await model.aclose()
    assert out._timer is None
