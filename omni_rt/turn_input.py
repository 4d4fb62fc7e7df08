"""A `respond()` call's input, checked and made ready off the event loop: argument types, a spoken
turn's features (or its live encoding), its placeholder count, and the output rates a session streams.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from omni_rt.audio.resample import StreamingResampler
from omni_rt.config import OUTPUT_SAMPLE_RATES, Sampling
from omni_rt.errors import InvalidRequestError
from omni_rt.live_speech import SpeechClip

__all__ = ["audio_token_count", "check_sample_rate", "check_types", "speech_features", "turn_audio"]

log = logging.getLogger("omni_rt")


def check_types(text, sampling, max_output_tokens, max_audio_frames, instructions=None) -> None:
    """Argument types of `respond()` that nothing downstream checks before a stage runner reads them (a
    voice's: the engine's `speaker_id`, for sessions and responses alike)."""
    for name, v in (("text", text), ("instructions", instructions)):
        if v is not None and not isinstance(v, str):
            raise InvalidRequestError(f"{name} must be a str, got {type(v).__name__}")
    if sampling is not None and not isinstance(sampling, Sampling):
        raise InvalidRequestError(f"sampling must be an omni_rt.Sampling, got {type(sampling).__name__}")
    for name, v in (("max_output_tokens", max_output_tokens), ("max_audio_frames", max_audio_frames)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | np.integer)):
            raise InvalidRequestError(f"{name} must be an int, got {v!r}")


async def turn_audio(audio: Any, rate: int) -> tuple[Any, Any]:
    """(log-mel features, encoder tokens or None) of a spoken turn, off the event loop: a `SpeechClip`'s
    encoding as it was made while the user spoke, else features of the whole clip (the Thinker encodes
    them). A clip whose stream failed is encoded whole, so nothing is lost."""
    if audio is None:
        return None, None
    if isinstance(audio, SpeechClip):
        try:
            return await audio.encoding()
        except Exception:
            log.warning("live speech encoding failed; the turn is encoded whole", exc_info=True)
            audio, rate = audio.audio, 16000
    return await asyncio.to_thread(speech_features, audio, rate), None


def speech_features(audio: Any, rate: int):
    """Log-mel features [128, F] of a spoken turn (16 kHz; 24 and 48 kHz are resampled first)."""
    from omni_rt.audio.features import SAMPLE_RATE, log_mel

    if rate != SAMPLE_RATE:
        if rate not in OUTPUT_SAMPLE_RATES:
            raise InvalidRequestError(f"unsupported audio sample rate {rate}; send 16, 24 or 48 kHz PCM")
        try:
            pcm = np.asarray(audio)
        except (TypeError, ValueError, RuntimeError) as e:  # e.g. a tensor on a GPU
            raise InvalidRequestError(f"audio must be a numpy array of PCM samples: {e}") from None
        if pcm.dtype == np.int16:
            pcm = pcm.astype(np.float32) / 32768.0
        elif not np.issubdtype(pcm.dtype, np.floating):  # as log_mel checks 16 kHz input
            raise InvalidRequestError(f"audio must be float or int16 PCM, got dtype {pcm.dtype}")
        if pcm.ndim != 1:
            raise InvalidRequestError(f"audio must be mono [samples], got shape {pcm.shape}")
        audio = StreamingResampler(rate, SAMPLE_RATE).push(pcm)
    return log_mel(audio, SAMPLE_RATE)


def audio_token_count(n_frames: int, n_window: int) -> int:
    """Placeholders a spoken turn of `n_frames` feature frames takes in the prompt."""
    from omni_rt.audio import features

    return int(features.audio_token_count(n_frames, n_window))


def check_sample_rate(rate: int) -> int:
    """`rate` if a session can stream PCM at it, else InvalidRequestError."""
    if rate not in OUTPUT_SAMPLE_RATES:
        raise InvalidRequestError(
            f"unsupported output sample rate {rate}; choose one of {list(OUTPUT_SAMPLE_RATES)}"
        )
    return rate
