"""AudioOutputTrack: feed PCM in, assert the frames out (pacing, pts, buffering, cancel, idle modes)."""

import asyncio
import time

import numpy as np
import pytest

pytest.importorskip("aiortc")

from omni_rt.audio.resample import resample  # noqa: E402
from omni_rt.server.track import FRAME_SAMPLES, SAMPLE_RATE, AudioOutputTrack  # noqa: E402

FRAME_S = FRAME_SAMPLES / SAMPLE_RATE


def sine(seconds: float, rate: int = 24000, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (8000 * np.sin(2 * np.pi * freq * t)).astype(np.int16)


async def drain(track: AudioOutputTrack, frames: int) -> list[tuple[float, object]]:
    out = []
    for _ in range(frames):
        frame = await asyncio.wait_for(track.recv(), 2.0)
        out.append((time.monotonic(), frame))
    return out


async def test_frames_are_20ms_48k_paced_with_contiguous_pts():
    events: list[tuple[str, str]] = []
    track = AudioOutputTrack(
        on_started=lambda r: events.append(("started", r)), on_stopped=lambda r: events.append(("stopped", r))
    )
    pcm = sine(0.5)

    async def feed():
        for chunk in np.array_split(pcm, 7):  # uneven chunks, like growing Code2Wav chunks
            await track.write(chunk, 24000, "resp_1")
        await track.end_response("resp_1")

    feeder = asyncio.create_task(feed())
    expected_frames = -(-int(0.5 * SAMPLE_RATE) // FRAME_SAMPLES)
    got = await drain(track, expected_frames)
    await feeder

    frames = [f for _, f in got]
    assert all(f.samples == FRAME_SAMPLES and f.sample_rate == SAMPLE_RATE for f in frames)
    assert all(f.format.name == "s16" and f.layout.name == "mono" for f in frames)
    assert [f.pts for f in frames] == [i * FRAME_SAMPLES for i in range(len(frames))]
    # Never ahead of real time: frame n leaves no earlier than n frames after frame 0 (small slack for
    # the event loop), and not as a burst either.
    t0 = got[0][0]
    for n, (t, _) in enumerate(got):
        assert t - t0 >= n * FRAME_S - 0.005, f"frame {n} left {n * FRAME_S - (t - t0):.3f} s early"
    # ...and not far behind either (generous: the machine may be busy; lateness re-anchors, never bursts).
    assert got[-1][0] - t0 < (len(got) - 1) * FRAME_S + 0.5
    # The audio is the resampled input, with no seams between the uneven chunks.
    sent = np.concatenate([f.to_ndarray().reshape(-1) for f in frames])
    want = np.clip(np.rint(resample(pcm.astype(np.float32), 24000, 48000)), -32768, 32767)
    assert np.abs(sent[: want.size].astype(np.int32) - want).max() <= 1
    assert not sent[want.size :].any()  # the padded tail of the last frame is silence
    assert events == [("started", "resp_1"), ("stopped", "resp_1")]


async def test_idle_nothing_sends_nothing_then_reanchors_without_a_burst():
    track = AudioOutputTrack(idle="nothing")
    await track.write(sine(0.04, 48000), 48000, "a")  # exactly 2 frames at 48 kHz: no resampling
    await track.end_response("a")
    first = await drain(track, 2)
    # Nothing to send: recv() waits instead of producing silence.
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(track.recv(), 0.15)

    async def later():
        await track.write(sine(0.1, 48000), 48000, "b")
        await track.end_response("b")

    feeder = asyncio.create_task(later())
    resumed = await drain(track, 5)
    await feeder
    pts = [f.pts for _, f in first + resumed]
    assert pts == [i * FRAME_SAMPLES for i in range(7)]  # contiguous across the idle gap
    assert track.reanchors >= 1
    times = [t for t, _ in resumed]
    # After the gap the frames are paced again, not sent as a catch-up burst.
    assert times[-1] - times[0] >= 4 * FRAME_S - 0.005


async def test_idle_silence_keeps_time_with_silent_frames():
    track = AudioOutputTrack(idle="silence")
    got = await drain(track, 5)
    assert track.silent_frames_sent == 5
    assert all(not f.to_ndarray().any() for _, f in got)
    assert got[-1][0] - got[0][0] >= 4 * FRAME_S - 0.005
    await track.write(sine(0.04, 48000), 48000, "r")
    audible = await drain(track, 2)
    assert all(f.to_ndarray().any() for _, f in audible)


async def test_a_response_starts_once_its_lead_is_buffered():
    started: list[str] = []
    track = AudioOutputTrack(idle="silence", start_lead_ms=100, max_buffer_ms=60, on_started=started.append)
    assert track.max_buffer_samples == SAMPLE_RATE // 10  # the lead fits, whatever the buffer's size
    await track.write(sine(0.06, 48000), 48000, "r")  # 3 frames: less than the lead
    waiting = await drain(track, 2)
    assert started == [] and track.silent_frames_sent == 2  # silence while the lead builds up
    assert track.buffered_ms == pytest.approx(60)
    await track.write(sine(0.04, 48000), 48000, "r")  # 100 ms buffered: it starts
    played = await drain(track, 5)
    assert started == ["r"] and all(f.to_ndarray().any() for _, f in played)
    sent = np.concatenate([f.to_ndarray().reshape(-1) for _, f in played])
    assert np.array_equal(sent, np.concatenate([sine(0.06, 48000), sine(0.04, 48000)]))  # all, in order
    assert all(not f.to_ndarray().any() for _, f in waiting)
    # Once playing, a frame goes as soon as there is one (the lead is only the start's)
    await track.write(sine(0.02, 48000), 48000, "r")
    assert (await asyncio.wait_for(track.recv(), 1.0)).to_ndarray().any()
    # A reply shorter than the lead plays when it ends.
    await track.write(sine(0.04, 48000), 48000, "short")
    assert not (await asyncio.wait_for(track.recv(), 1.0)).to_ndarray().any()
    await track.end_response("short")
    assert (await asyncio.wait_for(track.recv(), 1.0)).to_ndarray().any() and started == ["r", "short"]
    with pytest.raises(ValueError, match="start_lead_ms"):
        AudioOutputTrack(start_lead_ms=-1)


async def test_buffer_is_bounded_and_writers_wait_for_room():
    track = AudioOutputTrack(max_buffer_ms=60)
    writer = asyncio.create_task(track.write(sine(0.5, 48000), 48000, "r"))
    await asyncio.sleep(0.05)
    assert not writer.done()  # 500 ms does not fit in a 60 ms buffer
    assert track.buffered_ms <= 60
    peak = 0.0
    for _ in range(10):
        await track.recv()
        peak = max(peak, track.buffered_ms)
    assert peak <= 60
    writer.cancel()


async def test_clear_drops_queued_audio_and_releases_a_waiting_writer():
    stopped: list[str] = []
    track = AudioOutputTrack(max_buffer_ms=100, on_stopped=stopped.append)
    writer = asyncio.create_task(track.write(sine(1.0, 48000), 48000, "r"))
    await asyncio.sleep(0.02)
    assert track.buffered_ms == pytest.approx(100)
    dropped = track.clear()
    assert dropped == SAMPLE_RATE // 10
    await asyncio.wait_for(writer, 1.0)  # the rest of the cancelled audio is discarded, not queued
    assert track.buffered_ms == 0
    await track.end_response("r")  # a late end for a cleared response is ignored
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(track.recv(), 0.1)
    assert stopped == []
    # The track carries the next response normally.
    await track.write(sine(0.02, 48000), 48000, "next")
    frame = await asyncio.wait_for(track.recv(), 1.0)
    assert frame.to_ndarray().any()


async def test_stop_ends_recv_and_write():
    from aiortc.mediastreams import MediaStreamError

    track = AudioOutputTrack()
    pending = asyncio.create_task(track.recv())
    await asyncio.sleep(0.01)
    track.stop()
    with pytest.raises(MediaStreamError):
        await asyncio.wait_for(pending, 1.0)
    with pytest.raises(MediaStreamError):
        await track.write(sine(0.02), 24000, "r")


def test_idle_setting_is_validated():
    with pytest.raises(ValueError, match="idle"):
        AudioOutputTrack(idle="beep")
