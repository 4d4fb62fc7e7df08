"""A turn encoded while it is spoken equals the whole-turn encoding: features and encoder output within
1e-5, the same number of Thinker placeholders (so the same prompt tokens)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_audio_encoder import SMALL, make_pair

from omni_rt.audio.features import audio_token_count, log_mel
from omni_rt.errors import InvalidRequestError
from omni_rt.model.speech_stream import SpeechStream

SR = 16000


@pytest.fixture(scope="module")
def encoder():
    return make_pair(SMALL)[1]


def voice_like(seconds: float, seed: int = 0, loud_at: float | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    x = 0.2 * np.sin(2 * np.pi * 150 * t) * (
        0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)
    ) + 0.01 * rng.standard_normal(len(t))
    if loud_at is not None:  # the loudest moment late in the turn: the floor changes at the end
        i = int(loud_at * SR)
        x[i : i + SR // 10] *= 4.0
    return x.astype(np.float32)


@pytest.mark.parametrize(
    ("seconds", "chunk", "loud_at"),
    [
        (0.3, 320, None),
        (1.0, 320, None),
        (2.37, 480, None),
        (5.2, 320, None),
        (5.2, 7000, 4.9),
        (3.05, 1, None),
    ],
)
def test_streamed_turn_equals_whole_turn(encoder, seconds, chunk, loud_at):
    audio = voice_like(seconds, loud_at=loud_at)
    if chunk == 1:
        audio = audio[: SR // 2 + 123]  # one sample at a time: keep it short
    with torch.inference_mode():
        want_feats = log_mel(audio)
        want = encoder.encode(want_feats)
    stream = SpeechStream(encoder)
    for i in range(0, len(audio), chunk):
        stream.push(audio[i : i + chunk])
    feats, tokens = stream.finish()
    assert feats.shape == want_feats.shape
    assert (feats - want_feats).abs().max() < 1e-5
    assert tokens.shape == want.shape and tokens.shape[0] == audio_token_count(feats.shape[1])
    assert (tokens - want).abs().max() < 1e-5


def test_work_is_done_while_speaking(encoder):
    stream = SpeechStream(encoder)
    audio = voice_like(5.0)
    stream.push(audio[: 4 * SR + 300])  # 4 s in: every window and block of them final
    assert len(stream._windows) == 4 and len(stream._blocks) == 2  # SMALL: blocks of 2 windows
    stream.push(audio[4 * SR + 300 :])
    stream.finish()


def test_bad_audio_is_a_clear_error(encoder):
    stream = SpeechStream(encoder)
    with pytest.raises(InvalidRequestError):
        stream.push(np.zeros((2, 10), np.float32))
    with pytest.raises(InvalidRequestError):
        stream.push(np.array([np.nan], np.float32))
    stream.push(np.zeros(100, np.float32))
    with pytest.raises(InvalidRequestError):
        stream.finish()
