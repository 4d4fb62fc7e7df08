"""Audio helpers around the model: streaming resampling, mel features, voice activity and end of turn."""

from omni_rt.audio.resample import StreamingResampler, resample

__all__ = ["StreamingResampler", "resample"]
