"""Log-mel features of 16 kHz speech, as Qwen3-Omni's processor computes them (Whisper-style), in torch.

    feats = log_mel(audio)                          # audio [S] float at 16 kHz -> [128, S // 160]
    feats, mask = log_mel_batch([a, b])             # [B, 128, T], [B, T]: zero-padded to the longest
    n = audio_token_count(feats.shape[-1])          # Thinker placeholders for that many mel frames

The processor (transformers' `Qwen3OmniMoeProcessor`) runs `WhisperFeatureExtractor` with 128 bins,
n_fft 400 (25 ms), hop 160 (10 ms, so 100 frames/s), a periodic Hann window, `padding="longest"` and no
truncation. The recipe, which this module follows step by step:

    power spectrum of a centred (reflect-padded) STFT, last frame dropped -> S // 160 frames
    Slaney-normalised mel filter bank (0-8 kHz, Slaney mel scale)
    log10(max(mel, 1e-10)); floor at (max over the whole clip - 8); (x + 4) / 4

The floor uses the clip's maximum, so a clip's features are final only when the clip is complete; the
log power of each frame is final as soon as its window has arrived (`raw_log_mel`, `floor_log_mel`:
`omni_rt.model.speech_stream` computes a turn's frames as it is spoken).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch
from torch.nn import functional as F

from omni_rt.errors import InvalidRequestError

__all__ = [
    "HOP_LENGTH",
    "N_FFT",
    "N_MELS",
    "SAMPLE_RATE",
    "audio_token_count",
    "floor_log_mel",
    "log_mel",
    "log_mel_batch",
    "mel_filters",
    "raw_log_mel",
]

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
N_MELS = 128
# The audio encoder's conv front end sees `2 * n_window` mel frames at a time (1 s at n_window 50) and
# turns each full window into 13 tokens (100 -> 50 -> 25 -> 13 by three stride-2 convs).
TOKENS_PER_FULL_WINDOW = 13


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear (3 mels per 200 Hz) below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    mel = f / (200.0 / 3.0)
    log_step = math.log(6.4) / 27.0
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-12) / 1000.0) / log_step, mel)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    log_step = math.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(log_step * (m - 15.0)), m * (200.0 / 3.0))


@lru_cache(maxsize=4)
def mel_filters(n_mels: int = N_MELS, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Slaney-normalised triangular mel filters [n_fft // 2 + 1, n_mels] (float32), 0 Hz to 8 kHz.

    Computed in float64 and rounded once, as the reference builds its bank.
    """
    fft_hz = np.linspace(0.0, sample_rate // 2, n_fft // 2 + 1)  # [F]
    edges_hz = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(8000.0), n_mels + 2))  # [M + 2]
    lo, mid, hi = edges_hz[:-2], edges_hz[1:-1], edges_hz[2:]  # [M] each
    rising = (fft_hz[:, None] - lo) / (mid - lo)  # [F, M]
    falling = (hi - fft_hz[:, None]) / (hi - mid)  # [F, M]
    bank = np.maximum(0.0, np.minimum(rising, falling))
    bank *= 2.0 / (hi - lo)  # Slaney norm: every filter has the same area
    return torch.from_numpy(bank).to(torch.float32)


def _as_waveform(audio, name: str = "audio") -> torch.Tensor:
    """1-D float32 tensor from a numpy array or tensor; int16 PCM is scaled to [-1, 1)."""
    if isinstance(audio, np.ndarray):
        if audio.dtype == np.int16:
            audio = audio.astype(np.float32) / 32768.0
        elif not np.issubdtype(audio.dtype, np.floating):
            raise InvalidRequestError(f"{name} must be float or int16 PCM, got dtype {audio.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
    elif isinstance(audio, torch.Tensor):
        if audio.dtype == torch.int16:
            t = audio.float() / 32768.0
        elif audio.is_floating_point():
            t = audio.detach().float()
        else:
            raise InvalidRequestError(f"{name} must be float or int16 PCM, got dtype {audio.dtype}")
    else:
        raise InvalidRequestError(
            f"{name} must be a numpy array or a torch tensor, got {type(audio).__name__}"
        )
    if t.dim() != 1:
        raise InvalidRequestError(f"{name} must be mono [samples], got shape {tuple(t.shape)}")
    if t.numel() < N_FFT:
        raise InvalidRequestError(
            f"{name} has {t.numel()} samples; at least {N_FFT} ({1000 * N_FFT // SAMPLE_RATE} ms at 16 kHz) "
            "are needed for one mel frame"
        )
    if not bool(torch.isfinite(t).all()):
        raise InvalidRequestError(f"{name} contains NaN or infinite samples")
    return t


def _check_rate(sample_rate: int) -> None:
    if sample_rate != SAMPLE_RATE:
        raise InvalidRequestError(
            f"speech input must be {SAMPLE_RATE} Hz, got {sample_rate} Hz; resample it first "
            "(omni_rt.audio.resample)"
        )


def raw_log_mel(padded: torch.Tensor, n_mels: int = N_MELS) -> torch.Tensor:
    """log10 mel power of every whole 400-sample frame of `padded` [B, S'] (hop 160, no centring):
    [B, n_mels, 1 + (S' - 400) // 160], before the clip-wide floor. The one place frames are analysed:
    whole clips (`_log_mel`) and turns as they arrive (`omni_rt.model.speech_stream`) both come here."""
    window = torch.hann_window(N_FFT, device=padded.device)  # periodic, as the reference's
    spec = torch.stft(padded, N_FFT, HOP_LENGTH, window=window, center=False, return_complex=True)
    power = (spec.abs() ** 2).contiguous()  # [B, F, T]
    mel = mel_filters(n_mels).to(padded.device).T @ power  # [B, M, T]
    return torch.clamp(mel, min=1e-10).log10()


def floor_log_mel(logs: torch.Tensor, peak: torch.Tensor | float) -> torch.Tensor:
    """The floor and scale of the reference: an 80 dB range below the clip's loudest bin, (x + 4) / 4."""
    return (torch.maximum(logs, torch.as_tensor(peak, dtype=logs.dtype) - 8.0) + 4.0) / 4.0


def _log_mel(waves: torch.Tensor, n_mels: int = N_MELS) -> torch.Tensor:
    """waves [B, S] float32 -> [B, n_mels, S // hop], each row normalised by its own maximum."""
    # centred frames: reflect-pad half a window each side; the last (half-empty) frame is dropped
    padded = F.pad(waves[:, None], (N_FFT // 2, N_FFT // 2), mode="reflect")[:, 0]
    logs = raw_log_mel(padded, n_mels)[..., :-1]
    peak = logs.amax(dim=(1, 2), keepdim=True)  # [B, 1, 1]
    return floor_log_mel(logs, peak)


def log_mel(audio, sample_rate: int = SAMPLE_RATE, n_mels: int = N_MELS) -> torch.Tensor:
    """Log-mel features of one mono clip: audio [S] (float in [-1, 1], or int16) -> [n_mels, S // 160].

    Equal to transformers' `WhisperFeatureExtractor` as Qwen3-Omni's processor configures it, for one clip
    (128 bins); with 80 bins, Whisper's own (what Smart Turn takes).
    """
    _check_rate(sample_rate)
    return _log_mel(_as_waveform(audio)[None], n_mels)[0]


def log_mel_batch(clips: Sequence, sample_rate: int = SAMPLE_RATE) -> tuple[torch.Tensor, torch.Tensor]:
    """Several clips as the processor batches them: (features [B, 128, T], mask [B, T] int64).

    Shorter clips are zero-padded (in samples) to the longest before the STFT, as `padding="longest"`
    does, so their last frames see the padding. The mask is the reference's: every 160th sample of the
    padded sample mask, so a shorter clip of n samples gets ceil(n / 160) frames (its last one partly
    padding), capped at the batch's T = longest // 160.
    """
    _check_rate(sample_rate)
    if len(clips) == 0:
        raise InvalidRequestError("log_mel_batch needs at least one clip")
    waves = [_as_waveform(c, f"clip {i}") for i, c in enumerate(clips)]
    longest = max(w.numel() for w in waves)
    batch = torch.zeros(len(waves), longest)  # [B, S]
    for i, w in enumerate(waves):
        batch[i, : w.numel()] = w
    feats = _log_mel(batch)  # [B, M, T]
    frames = torch.tensor([min(-(-w.numel() // HOP_LENGTH), feats.shape[-1]) for w in waves])  # [B]
    mask = (torch.arange(feats.shape[-1])[None] < frames[:, None]).long()  # [B, T]
    return feats, mask


def audio_token_count(n_frames: int | torch.Tensor, n_window: int = 50) -> int | torch.Tensor:
    """Audio encoder output tokens (= Thinker placeholders) for `n_frames` mel frames.

    The encoder cuts the frames into windows of `2 * n_window`; each full window gives 13 tokens and the
    remainder r gives ceil(ceil(ceil(r / 2) / 2) / 2) (three stride-2 convs with padding 1). About 13 per
    second at 100 frames/s. Works elementwise on an integer tensor too (the reference's
    `_get_feat_extract_output_lengths`).
    """
    if isinstance(n_frames, torch.Tensor):
        if n_frames.is_floating_point():
            raise InvalidRequestError(f"frame counts must be integers, got {n_frames.dtype}")
        if bool((n_frames < 0).any()):
            raise InvalidRequestError("frame counts must be >= 0")
    elif n_frames < 0:
        raise InvalidRequestError(f"frame count must be >= 0, got {n_frames}")
    window = 2 * n_window
    rest = n_frames % window
    for _ in range(3):
        rest = (rest + 1) // 2  # ceil(r / 2): one stride-2 conv of kernel 3, padding 1 (0 stays 0)
    return rest + (n_frames // window) * TOKENS_PER_FULL_WINDOW
