"""Log-mel features equal transformers' WhisperFeatureExtractor as Qwen3-Omni's processor runs it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_rt.audio.features import (
    HOP_LENGTH,
    audio_token_count,
    log_mel,
    log_mel_batch,
    mel_filters,
)
from omni_rt.errors import InvalidRequestError


@pytest.fixture(scope="module")
def extractor():
    from transformers import WhisperFeatureExtractor

    # Qwen3-Omni's preprocessor_config.json: feature_size 128, hop 160, n_fft 400, 16 kHz, no dither
    return WhisperFeatureExtractor(
        feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400, chunk_length=300, dither=0.0
    )


def reference(extractor, clips):
    """The extractor with the processor's audio kwargs (padding longest, no truncation, a mask)."""
    out = extractor(
        clips if len(clips) > 1 else clips[0],
        sampling_rate=16000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    return out["input_features"], out["attention_mask"]


def sine(seconds: float, hz: float, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    return (amp * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def test_mel_filters_equal_transformers():
    from transformers.audio_utils import mel_filter_bank

    ref = mel_filter_bank(
        num_frequency_bins=201,
        num_mel_filters=128,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=16000,
        norm="slaney",
        mel_scale="slaney",
    )
    torch.testing.assert_close(mel_filters(), torch.from_numpy(ref).float(), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("n", [16000, 12345, 400, 161 * 160])
def test_random_audio_equals_extractor(extractor, n):
    audio = np.random.default_rng(n).uniform(-0.8, 0.8, n).astype(np.float32)
    ref, mask = reference(extractor, [audio])
    ours = log_mel(audio)
    assert ours.shape == (128, n // HOP_LENGTH) == ref.shape[1:]
    assert int(mask.sum()) == n // HOP_LENGTH
    torch.testing.assert_close(ours, ref[0], atol=1e-4, rtol=0)


def test_sine_with_silence_hits_the_floor(extractor):
    # a quiet tone then digital silence: the silence sits at the floor (clip max - 8), which the
    # normalisation must compute over the whole clip exactly as the reference does
    audio = np.concatenate([sine(0.7, 440.0, 0.3), np.zeros(5000, np.float32), sine(0.3, 3000.0, 0.05)])
    ref, _ = reference(extractor, [audio])
    ours = log_mel(audio)
    torch.testing.assert_close(ours, ref[0], atol=1e-4, rtol=0)
    assert float(ours.max() - ours.min()) == pytest.approx(2.0, abs=1e-5)  # 8 decades / 4


def test_int16_and_tensor_inputs_match_float():
    audio = sine(0.5, 220.0)
    pcm = np.round(audio * 32767).astype(np.int16)
    torch.testing.assert_close(log_mel(pcm), log_mel(pcm.astype(np.float32) / 32768.0))
    torch.testing.assert_close(log_mel(torch.from_numpy(audio)), log_mel(audio))


def test_batch_equals_extractor_padding(extractor):
    rng = np.random.default_rng(1)
    clips = [rng.uniform(-0.5, 0.5, 9000).astype(np.float32), sine(1.3, 800.0)]
    ref, ref_mask = reference(extractor, clips)
    feats, mask = log_mel_batch(clips)
    assert feats.shape == ref.shape and torch.equal(mask, ref_mask.long())
    torch.testing.assert_close(feats, ref, atol=1e-4, rtol=0)
    # the longest clip alone is unaffected by batching
    torch.testing.assert_close(feats[1, :, : mask[1].sum()], log_mel(clips[1]), atol=1e-5, rtol=0)


def test_token_count_equals_reference():
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    n = torch.arange(0, 1500)
    torch.testing.assert_close(audio_token_count(n), _get_feat_extract_output_lengths(n, 50))
    assert audio_token_count(100) == 13 and audio_token_count(300) == 39 and audio_token_count(1) == 1
    assert audio_token_count(150) == 13 + 7
    assert isinstance(audio_token_count(250), int)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros(100, np.float32),  # shorter than one FFT window
        np.zeros((2, 16000), np.float32),  # stereo
        np.array([0.0, np.nan] * 400, np.float32),
        np.zeros(1000, np.int32),
        [0.0] * 1000,
    ],
)
def test_bad_audio_is_a_typed_error(bad):
    with pytest.raises(InvalidRequestError):
        log_mel(bad)


def test_wrong_rate_and_counts_are_typed_errors():
    with pytest.raises(InvalidRequestError, match="16000 Hz"):
        log_mel(np.zeros(48000, np.float32), sample_rate=48000)
    with pytest.raises(InvalidRequestError):
        log_mel_batch([])
    with pytest.raises(InvalidRequestError):
        audio_token_count(-1)
