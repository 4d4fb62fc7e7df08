"""The adapters' input audio (omni_rt.integrations._audio): framework PCM frames at any rate become 16 kHz
mono, resampled once as a stream; framework-cut turns keep their lead-in and stay bounded."""

from __future__ import annotations

import numpy as np
import pytest

from omni_rt.audio.resample import resample
from omni_rt.errors import InvalidRequestError
from omni_rt.integrations._audio import InputAudio, TurnBuffer


def tone(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype(np.int16)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_stream_of_stereo_frames_is_one_resampling_of_the_downmix(rate: int) -> None:
    mono = tone(0.5, rate)
    left, right = mono, (mono // 2).astype(np.int16)
    stereo = np.stack([left, right], axis=1).reshape(-1)  # interleaved L R L R ...
    audio = InputAudio()
    step = rate // 100 * 2  # 10 ms frames of two channels
    got = np.concatenate(
        [audio.push(stereo[i : i + step].tobytes(), rate, 2) for i in range(0, len(stereo), step)]
    )
    whole = resample((left.astype(np.float32) + right) / 2 / 32768, rate, 16000)
    assert len(got) <= len(whole) and np.allclose(got, whole[: len(got)], atol=1e-5)
    assert (
        len(whole) - len(got) <= 17 * 16000 / rate + 1
    )  # only the filter's 16-sample look-ahead is held back


def test_a_rate_change_hands_out_the_old_tail_first() -> None:
    audio = InputAudio()
    a = audio.push(tone(0.1, 48000).tobytes(), 48000, 1)
    b = audio.push(tone(0.1, 16000).tobytes(), 16000, 1)  # 16 kHz passes straight through
    assert len(a) + len(b) == pytest.approx(1600 + 1600, abs=2)


@pytest.mark.parametrize(
    ("data", "rate", "channels"),
    [(b"\x00\x00\x00", 16000, 1), (b"\x00" * 6, 16000, 2), (b"\x00\x00", 0, 1), (b"\x00\x00", 16000, 0)],
)
def test_bad_frames_are_clear_errors_and_lose_nothing(data: bytes, rate: int, channels: int) -> None:
    audio = InputAudio()
    first = audio.push(tone(0.1, 16000).tobytes(), 16000, 1)
    with pytest.raises(InvalidRequestError):
        audio.push(data, rate, channels)
    assert len(first) == 1600 and len(audio.push(tone(0.1, 16000).tobytes(), 16000, 1)) == 1600


def test_turn_keeps_its_lead_in_and_is_bounded() -> None:
    buf = TurnBuffer(preroll_ms=100, max_turn_ms=1000)
    buf.push(np.ones(16000, np.float32))  # a second of audio before the turn: only the lead-in stays
    assert buf.duration_ms == 100
    buf.start()
    buf.push(np.full(8000, 2.0, np.float32))
    turn = buf.take()
    assert len(turn) == 1600 + 8000 and turn[0] == 1.0 and turn[-1] == 2.0
    assert buf.take() is None and not buf.open
    buf.start()
    buf.push(np.zeros(32000, np.float32))  # 2 s in a turn of at most 1 s: the newest second stays
    assert buf.duration_ms == 1000


def test_push_to_talk_buffer_holds_everything_until_taken() -> None:
    buf = TurnBuffer(preroll_ms=0, always_open=True)
    buf.push(np.ones(4000, np.float32))
    buf.push(np.ones(4000, np.float32))
    assert len(buf.take()) == 8000 and buf.open
    buf.push(np.ones(10, np.float32))
    buf.clear()
    assert buf.take() is None
