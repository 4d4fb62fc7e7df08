"""server_vad on Silero VAD: event times follow the OpenAI Realtime semantics, on a clip set made here
(espeak-ng speech, hum, fan, white noise, music-like chords), exactly one turn per utterance and none on
anything else."""

from __future__ import annotations

import numpy as np
import pytest
from audio_clips import SR, cat, chords, fan, hum, needs_espeak, over_noise, silence, speech, white

from omni_rt.audio.vad import (
    FRAME_MS,
    ServerVad,
    SpeechStarted,
    SpeechStopped,
    Turn,
    TurnSegmenter,
    VadConfig,
)
from omni_rt.errors import ConfigError, InvalidRequestError

pytest.importorskip("onnxruntime")

SENTENCE = "What is the capital of France?"


def ms(x: np.ndarray) -> int:
    return len(x) * 1000 // SR


def run(audio: np.ndarray, cfg: VadConfig | None = None, chunk: int | None = 320):
    vad = ServerVad(cfg)
    if chunk is None:
        return vad.push(audio), vad
    events = []
    for i in range(0, len(audio), chunk):
        events += vad.push(audio[i : i + chunk])
    return events, vad


NOISES = {
    "hum -30 dBFS": lambda n: hum(n),
    "hum -40 dBFS": lambda n: hum(n, -40.0),
    "fan -30 dBFS": lambda n: fan(n),
    "white -30 dBFS": lambda n: white(n),
    "chords -30 dBFS": lambda n: chords(n),
}


@pytest.mark.parametrize("name", NOISES)
def test_non_speech_is_never_a_turn(name):
    events, vad = run(NOISES[name](6000))
    assert events == [] and not vad.in_speech, name


@needs_espeak
@pytest.mark.parametrize("background", [None, "fan", "white", "hum"])
def test_one_utterance_is_one_turn_in_silence_and_at_10_db_snr(background):
    voice = speech(SENTENCE)
    clip = cat(silence(700), voice, silence(1200))
    if background is not None:
        noise = {"fan": fan, "white": white, "hum": hum}[background](ms(clip) + 50)[: len(clip)]
        clip = over_noise(cat(silence(700), voice), noise, snr_db=10.0)
        # over_noise scales the voice to the noise: the mix is the noise, plus the voice from 700 ms
    onset, end = 700, 700 + ms(voice)
    events, vad = run(clip)
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped], events
    started, stopped = events
    # the turn's audio reaches back prefix_padding_ms before the first speech frame, which is within
    # two frames of the voice's onset
    assert onset - 300 - 2 * FRAME_MS <= started.audio_start_ms <= onset - 300 + 2 * FRAME_MS
    # the voice ends within a few frames of where espeak stopped (Silero holds on a little longer in
    # noise); the turn 500 ms (rounded up to a frame) after that
    assert end - FRAME_MS <= stopped.speech_end_ms <= end + 6 * FRAME_MS
    assert stopped.speech_end_ms + 500 <= stopped.audio_end_ms < stopped.speech_end_ms + 500 + FRAME_MS
    assert not vad.in_speech


@needs_espeak
def test_twelve_seconds_of_hum_with_speech_at_eight_seconds_is_one_turn_at_eight_seconds():
    voice = speech("Turn on the kitchen lights, please.")
    background = hum(12_000)
    clip = background.copy()
    clip[8 * SR : 8 * SR + len(voice)] += voice * 0.5
    events, _ = run(clip)
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped], events
    assert 8000 - 300 - 2 * FRAME_MS <= events[0].audio_start_ms <= 8000 - 300 + 2 * FRAME_MS


@needs_espeak
def test_utterances_apart_are_one_turn_each_a_short_pause_keeps_one():
    a, b = speech("Good morning."), speech("How are you today?")
    events, _ = run(cat(silence(500), a, silence(1500), b, silence(1000)))
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped] * 2
    events, _ = run(cat(silence(500), a, silence(250), b, silence(1000)))
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped]


@needs_espeak
def test_any_chunking_gives_the_same_events_and_int16_matches_float():
    clip = cat(silence(600), speech("Good morning."), silence(900), speech("See you."), silence(900))
    whole, _ = run(clip, chunk=None)
    assert len(whole) == 4
    for chunk in (1, 160, 333, 512, 4801):
        assert run(clip, chunk=chunk)[0] == whole, chunk
    pcm = np.round(np.clip(clip, -1, 1) * 32767).astype(np.int16)
    assert run(pcm)[0] == run(pcm.astype(np.float32) / 32768.0)[0]
    vad = ServerVad()
    first = vad.push(clip)
    vad.reset()
    assert vad.elapsed_ms == 0 and vad.push(clip) == first


@needs_espeak
def test_settings_change_the_times():
    voice = speech(SENTENCE)
    clip = cat(silence(1000), voice, silence(1200))
    (s1, e1), _ = run(clip)
    (s2, e2), _ = run(clip, VadConfig(prefix_padding_ms=100, silence_duration_ms=200))
    assert s2.audio_start_ms == s1.audio_start_ms + 200
    assert e2.speech_end_ms == e1.speech_end_ms
    assert e2.audio_end_ms - e2.speech_end_ms < e1.audio_end_ms - e1.speech_end_ms - 250
    # the same voice, 50 dB down: Silero's probability stays under a high threshold
    quiet = cat(silence(500), voice * 10 ** (-50 / 20), silence(800))
    assert run(quiet, VadConfig(threshold=0.9))[0] == []


def test_bad_input_and_settings_are_typed_errors():
    with pytest.raises(InvalidRequestError):
        ServerVad().push(np.zeros((2, 320), np.float32))
    with pytest.raises(InvalidRequestError):
        ServerVad().push(np.zeros(320, np.int32))
    with pytest.raises(InvalidRequestError):
        ServerVad().push(np.full(320, np.nan, np.float32))
    for bad in ({"threshold": 1.5}, {"silence_duration_ms": 0}, {"prefix_padding_ms": -1}, {"release": 0.6}):
        with pytest.raises(ConfigError):
            VadConfig(**bad)


def segment(audio: np.ndarray, chunk: int, cfg: VadConfig | None = None):
    seg = TurnSegmenter(cfg)
    out = []
    for i in range(0, len(audio), chunk):
        out += seg.push(audio[i : i + chunk])
    return out, seg


@needs_espeak
@pytest.mark.parametrize("chunk", [320, 1000, 7, 10**6])
def test_turns_carry_exactly_their_audio(chunk):
    clip = cat(silence(1000), speech("Good morning."), silence(800), speech("See you."), silence(900))
    out, seg = segment(clip, chunk)
    assert [type(e) for e in out] == [SpeechStarted, SpeechStopped, Turn] * 2
    vad_events = run(clip)[0]
    # ServerVad's events, except that a prefix never reaches back into the previous turn
    assert out[0] == vad_events[0] and out[1] == vad_events[1]
    assert out[3].audio_start_ms == max(vad_events[2].audio_start_ms, out[2].audio_end_ms)
    for turn, stopped in ((out[2], out[1]), (out[5], out[4])):
        a, b = turn.audio_start_ms * 16, turn.audio_end_ms * 16
        assert np.array_equal(turn.audio, clip[a:b])
        assert turn.speech_end_ms == stopped.speech_end_ms
    # idle memory stays bounded: prefix padding + min speech + two frames (+ the last chunk's tail)
    buffered = sum(len(c) for c in seg._chunks)
    assert buffered <= (300 + 64 + 2 * FRAME_MS) * 16 + chunk + 512  # + a frame not yet analysed


@needs_espeak
def test_commit_ends_a_turn_early_and_clear_drops_it():
    voice = speech("Good morning.")
    seg = TurnSegmenter()
    out = seg.push(cat(silence(500), voice, silence(200)))  # a pause shorter than the window
    assert [type(e) for e in out] == [SpeechStarted] and seg.in_speech
    turn = seg.commit()
    assert turn is not None and turn.audio_start_ms == out[0].audio_start_ms
    assert turn.audio_end_ms == seg.elapsed_ms and turn.speech_end_ms is None
    assert not seg.in_speech and seg.commit() is None
    assert seg.push(silence(1000)) == []  # no speech_stopped for a committed turn
    seg.push(voice)
    assert seg.in_speech
    seg.clear()
    assert not seg.in_speech and seg.commit() is None


@needs_espeak
def test_a_turn_after_a_commit_mid_speech_does_not_reach_back_into_it():
    voice = speech("I was going to say something rather longer than this.")
    seg = TurnSegmenter()
    seg.push(cat(silence(500), voice[:SR]))
    first = seg.commit()  # mid-speech: the speaker goes on
    out = seg.push(cat(voice[SR:], silence(800)))
    assert [type(e) for e in out] == [SpeechStarted, SpeechStopped, Turn]
    assert out[0].audio_start_ms == first.audio_end_ms  # not 300 ms before the speech went on


def test_without_detection_a_turn_is_everything_since_the_last_commit_or_clear():
    audio = white(1500, -20.0)
    seg = TurnSegmenter(detect=False)
    assert seg.vad._model is None  # no detector: no model loaded, no events
    assert seg.push(audio) == []
    assert not seg.in_speech and seg.turn_ms == 1500
    turn = seg.commit()
    assert turn is not None and (turn.audio_start_ms, turn.audio_end_ms) == (0, 1500)
    assert np.array_equal(turn.audio, audio)
    seg.push(silence(200))
    seg.clear()
    assert seg.turn_ms == 0
    later = white(400, seed=3)
    seg.push(later)
    turn = seg.commit()
    assert (turn.audio_start_ms, turn.audio_end_ms) == (1700, 2100)
    assert np.array_equal(turn.audio, later)
    assert sum(len(c) for c in seg._chunks) <= len(later)  # nothing older is kept
