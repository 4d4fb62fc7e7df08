"""Audio helpers around the model: streaming resampling (and later 20 ms framing, mel features, VAD)."""

from omni_rt.audio.resample import StreamingResampler, resample

__all__ = ["StreamingResampler", "resample"]
