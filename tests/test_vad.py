"""Server VAD on synthetic audio: event times follow the OpenAI Realtime server_vad semantics."""

from __future__ import annotations

import numpy as np
import pytest

from omni_rt.audio.vad import ServerVad, SpeechStarted, SpeechStopped, Turn, TurnSegmenter, VadConfig
from omni_rt.errors import ConfigError, InvalidRequestError

SR = 16000


def noise(ms: int, amp: float = 0.01, seed: int = 0) -> np.ndarray:
    return (amp * np.random.default_rng(seed).standard_normal(ms * SR // 1000)).astype(np.float32)


def voice(ms: int, amp: float = 0.3, seed: int = 1) -> np.ndarray:
    """A voiced-like burst: 150 Hz with two harmonics, plus the same background noise."""
    t = np.arange(ms * SR // 1000) / SR
    x = amp * (
        np.sin(2 * np.pi * 150 * t) + 0.5 * np.sin(2 * np.pi * 300 * t) + 0.25 * np.sin(2 * np.pi * 450 * t)
    )
    return (x + noise(ms, seed=seed)).astype(np.float32)


def run(audio: np.ndarray, cfg: VadConfig | None = None, chunk: int | None = None):
    vad = ServerVad(cfg)
    if chunk is None:
        return vad.push(audio), vad
    events = []
    for i in range(0, len(audio), chunk):
        events += vad.push(audio[i : i + chunk])
    return events, vad


def test_silence_and_background_noise_are_not_speech():
    events, vad = run(np.zeros(3 * SR, np.float32))
    assert events == [] and not vad.in_speech and vad.elapsed_ms == 3000
    events, _ = run(noise(3000))
    assert events == []
    events, _ = run(noise(2000, amp=0.2))  # loud hiss: high zero-crossing rate, not a voice
    assert events == []


def test_burst_in_noise_gives_one_turn_with_padding_and_silence_window():
    audio = np.concatenate([noise(1000), voice(1000), noise(1000, seed=3)])
    events, vad = run(audio)
    # starts at 1000 ms minus the 300 ms prefix; stops 500 ms after the burst ends
    assert events == [SpeechStarted(audio_start_ms=700), SpeechStopped(audio_end_ms=2500)]
    assert events[0].type == "input_audio_buffer.speech_started"
    assert events[1].type == "input_audio_buffer.speech_stopped"
    assert not vad.in_speech


def test_short_pause_keeps_the_turn_long_pause_splits_it():
    short = np.concatenate(
        [noise(500), voice(600), noise(300, seed=5), voice(600, seed=6), noise(800, seed=7)]
    )
    events, _ = run(short)
    assert events == [SpeechStarted(200), SpeechStopped(500 + 600 + 300 + 600 + 500)]

    long = np.concatenate(
        [noise(500), voice(600), noise(700, seed=5), voice(600, seed=6), noise(800, seed=7)]
    )
    events, _ = run(long)
    assert events == [
        SpeechStarted(200),
        SpeechStopped(1100 + 500),
        SpeechStarted(1800 - 300),
        SpeechStopped(2400 + 500),
    ]


def test_any_chunking_gives_the_same_events():
    audio = np.concatenate(
        [noise(700), voice(900), noise(650, seed=2), voice(300, seed=4), noise(900, seed=8)]
    )
    whole, _ = run(audio)
    assert len(whole) == 4
    for chunk in (1, 160, 333, 320, 4801):
        assert run(audio, chunk=chunk)[0] == whole, chunk


def test_speech_at_time_zero_and_unaligned_onsets():
    events, vad = run(voice(400))
    assert events == [SpeechStarted(audio_start_ms=0)] and vad.in_speech  # padding clamps at 0
    # onset 1234 ms: detected within one 20 ms frame of it
    events, _ = run(np.concatenate([noise(1234), voice(500), noise(600, seed=9)]))
    assert isinstance(events[0], SpeechStarted) and abs(events[0].audio_start_ms - (1234 - 300)) <= 20
    assert isinstance(events[1], SpeechStopped) and abs(events[1].audio_end_ms - (1734 + 500)) <= 20


def test_a_click_is_not_a_turn():
    audio = noise(1000)
    audio[8000:8160] += 0.8  # 10 ms step: at most one loud frame
    assert run(audio)[0] == []


def test_settings_change_the_times():
    audio = np.concatenate([noise(1000), voice(1000), noise(1000, seed=3)])
    cfg = VadConfig(prefix_padding_ms=100, silence_duration_ms=200)
    assert run(audio, cfg)[0] == [SpeechStarted(900), SpeechStopped(2200)]
    # a threshold above what the voice reaches: nothing
    quiet = np.concatenate([noise(500), voice(800, amp=0.003), noise(500)])
    assert run(quiet)[0] == []


def test_int16_matches_float_and_reset_restarts_time():
    audio = np.concatenate([noise(600), voice(700), noise(700, seed=3)])
    pcm = np.round(np.clip(audio, -1, 1) * 32767).astype(np.int16)
    assert run(pcm)[0] == run(pcm.astype(np.float32) / 32768.0)[0]
    vad = ServerVad()
    first = vad.push(audio)
    vad.reset()
    assert vad.elapsed_ms == 0 and vad.push(audio) == first


def test_bad_input_and_settings_are_typed_errors():
    with pytest.raises(InvalidRequestError):
        ServerVad().push(np.zeros((2, 320), np.float32))
    with pytest.raises(InvalidRequestError):
        ServerVad().push(np.zeros(320, np.int32))
    with pytest.raises(ConfigError):
        VadConfig(threshold=1.5)
    with pytest.raises(ConfigError):
        VadConfig(silence_duration_ms=510)


def test_a_steady_hum_does_not_hold_a_turn_forever():
    t = np.arange(12 * SR) / SR
    hum = (0.05 * np.sin(2 * np.pi * 100 * t)).astype(np.float32) + noise(12000)
    events, vad = run(hum)
    # the hum may open a turn at first, but the rising floor closes it within seconds and nothing follows
    assert not vad.in_speech and len(events) <= 2
    if events:
        assert isinstance(events[-1], SpeechStopped) and events[-1].audio_end_ms < 8000
    assert run(np.concatenate([hum, voice(800, seed=11), noise(800, seed=12)]))[0][-2:] == [
        SpeechStarted(12000 - 300),
        SpeechStopped(12800 + 500),
    ]


def segment(audio: np.ndarray, chunk: int):
    seg = TurnSegmenter()
    out = []
    for i in range(0, len(audio), chunk):
        out += seg.push(audio[i : i + chunk])
    return out, seg


@pytest.mark.parametrize("chunk", [320, 1000, 7, 10**6])
def test_turns_carry_exactly_their_audio(chunk):
    audio = np.concatenate(
        [noise(1000), voice(600), noise(700, seed=5), voice(500, seed=6), noise(900, seed=7)]
    )
    out, seg = segment(audio, chunk)
    assert [type(e) for e in out] == [SpeechStarted, SpeechStopped, Turn] * 2
    vad_events = run(audio)[0]
    # ServerVad's events, except that the second turn's prefix stops where the first turn ended (the
    # Realtime API's buffer is empty after a commit): no audio belongs to two turns
    assert vad_events[2] == SpeechStarted(2000)
    assert [e for e in out if not isinstance(e, Turn)] == [
        *vad_events[:2],
        SpeechStarted(2100),
        vad_events[3],
    ]
    for turn in (out[2], out[5]):
        a, b = turn.audio_start_ms * 16, turn.audio_end_ms * 16
        assert np.array_equal(turn.audio, audio[a:b])
    assert (out[2].audio_start_ms, out[2].audio_end_ms) == (700, 2100)
    # idle memory stays bounded: prefix padding + min speech + two frames (+ the last chunk's tail)
    buffered = sum(len(c) for c in seg._chunks)
    assert buffered <= (300 + 60 + 40) * 16 + chunk


def test_commit_ends_a_turn_early_and_clear_drops_it():
    audio = np.concatenate([noise(500), voice(1000)])
    seg = TurnSegmenter()
    out = seg.push(audio)
    assert out == [SpeechStarted(200)] and seg.in_speech
    turn = seg.commit()
    assert turn is not None and (turn.audio_start_ms, turn.audio_end_ms) == (200, 1500)
    assert np.array_equal(turn.audio, audio[200 * 16 : 1500 * 16])
    assert not seg.in_speech and seg.commit() is None
    assert seg.push(noise(1000, seed=4)) == []  # no speech_stopped for a committed turn

    seg.push(voice(400, seed=5))
    assert seg.in_speech
    seg.clear()
    assert not seg.in_speech and seg.commit() is None


def test_without_detection_a_turn_is_everything_since_the_last_commit_or_clear():
    audio = np.concatenate([noise(300), voice(500), noise(700, seed=4)])
    seg = TurnSegmenter(detect=False)
    assert seg.push(audio) == []  # no detector: no events, however speech-like the audio
    assert not seg.in_speech and seg.turn_ms == 1500
    turn = seg.commit()
    assert turn is not None and (turn.audio_start_ms, turn.audio_end_ms) == (0, 1500)
    assert np.array_equal(turn.audio, audio)
    seg.push(noise(200, seed=8))
    seg.clear()
    assert seg.turn_ms == 0
    later = voice(400, seed=9)
    seg.push(later)
    turn = seg.commit()
    assert (turn.audio_start_ms, turn.audio_end_ms) == (1700, 2100)
    assert np.array_equal(turn.audio, later)
    assert sum(len(c) for c in seg._chunks) <= len(later)  # nothing older is kept


def test_turn_ms_counts_the_open_turn():
    seg = TurnSegmenter()
    seg.push(noise(500))
    assert seg.turn_ms == 0
    seg.push(voice(1000))  # speech from 500 ms; the turn opened at 200 ms (300 ms prefix)
    assert seg.in_speech and seg.turn_ms == 1300
    with pytest.raises(ConfigError):
        VadConfig(silence_duration_ms=0)  # would end every turn on its first frame


def test_a_turn_after_a_commit_does_not_reach_back_into_it():
    seg = TurnSegmenter()
    seg.push(noise(500))
    seg.push(voice(600))
    first = seg.commit()  # mid-speech: the speaker goes on
    out = seg.push(np.concatenate([voice(600, seed=2), noise(800, seed=3)]))
    assert [type(e) for e in out] == [SpeechStarted, SpeechStopped, Turn]
    assert out[0].audio_start_ms == first.audio_end_ms == 1100  # not 1100 + 60 - 300
    assert out[2].audio_start_ms == 1100
