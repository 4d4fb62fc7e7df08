"""A spoken turn encoded while it is spoken: features and audio-encoder windows as the audio arrives, off
the event loop, so the end of the turn leaves only the last window and the prefill.

    live = session.live_speech()              # one per turn (None: the model has no audio encoder)
    live.push(pcm_16k)                        # returns at once; the work runs on the speech worker
    clip = live.clip()                        # the turn so far, encoded as a finished turn
    async for ev in session.respond(audio=clip): ...   # the Thinker gets the encoding as it is

A clip is exactly the whole-turn encoding of the same samples (`SpeechStream`: features and tokens
within float rounding of `log_mel` + `AudioEncoder.encode`, equal tokens); taking one does not end the
stream, so a speculative reply can take the turn at a pause and the turn still go on.

Where the work runs: one thread per engine, shared by its sessions (`SpeechWorker`), never the event
loop; on a CUDA device in a stream of the lowest priority, so the Talker's and Code2Wav's steps of the
other sessions (higher-priority streams) go first.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from omni_rt.errors import InvalidRequestError

__all__ = ["LiveSpeech", "SpeechClip", "SpeechWorker"]


class SpeechWorker:
    """The thread that encodes every session's live speech on one engine."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speech-encoder")
        self._stream: Any = None  # the CUDA stream, made on the worker thread at its first job

    def submit(self, fn: Any, *args: Any) -> Future:
        return self._pool.submit(self._run, fn, *args)

    def _run(self, fn: Any, *args: Any) -> Any:
        import torch

        device = self.encoder.proj2.weight.device
        if device.type != "cuda":
            return fn(*args)
        if self._stream is None:
            # priority 0 is the lowest CUDA offers (the pipeline's Talker and Code2Wav run above it)
            self._stream = torch.cuda.Stream(device=device, priority=0)
        with torch.cuda.stream(self._stream):
            out = fn(*args)
        self._stream.synchronize()  # the Thinker's stream reads the tokens: they are whole before it does
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class SpeechClip:
    """A turn as encoded by a `LiveSpeech` up to some sample: (features [128, F], tokens [N, D]) once the
    worker has them. Keeps its audio, so a failed stream still leaves the turn to be encoded whole."""

    def __init__(self, audio: np.ndarray, encoding: Future) -> None:
        self.audio = audio  # 16 kHz float32 samples of the turn
        self._encoding = encoding

    @property
    def samples(self) -> int:
        return len(self.audio)

    async def encoding(self) -> tuple[Any, Any]:
        """(features, tokens); the stream's error if it failed (the caller may encode `audio` whole)."""
        return await asyncio.wrap_future(self._encoding)

    def same_audio(self, audio: np.ndarray) -> bool:
        """Whether `audio` is exactly this clip's samples (what a turn committed later must be)."""
        return len(audio) == len(self.audio) and np.array_equal(audio, self.audio)


class LiveSpeech:
    """One turn's audio, encoded as it arrives (see the module doc). Methods are for the event loop."""

    def __init__(self, worker: SpeechWorker) -> None:
        from omni_rt.model.speech_stream import SpeechStream

        self._worker = worker
        self._stream = SpeechStream(worker.encoder)
        self._chunks: list[np.ndarray] = []  # every sample pushed, in order (a clip's own audio)
        self._error: BaseException | None = None  # the stream's, on the worker: clips encode whole
        self.samples = 0

    def push(self, audio: np.ndarray) -> None:
        """16 kHz mono float PCM; checked here, so bad input is refused before anything is queued."""
        a = np.asarray(audio)
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.floating) or not np.isfinite(a).all():
            raise InvalidRequestError("speech input must be finite float mono PCM at 16 kHz")
        if not len(a):
            return
        a = a.astype(np.float32)
        self._chunks.append(a)
        self.samples += len(a)
        # One job per push on the one worker thread: jobs run in order, so a clip taken after a push
        # sees exactly the samples pushed before it. A push costs the stream a copy, except the one
        # that completes a conv window (every 2 * n_window mel frames), which encodes it.
        self._worker.submit(self._push, a)

    def clip(self) -> SpeechClip:
        """The turn so far (every sample pushed until now) as a finished turn; the stream goes on."""
        audio = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
        return SpeechClip(audio, self._worker.submit(self._finish_fork))

    # -- on the worker thread ------------------------------------------------------------------------

    def _push(self, audio: np.ndarray) -> None:
        if self._error is None:
            try:
                self._stream.push(audio)
            except Exception as e:  # kept for the clips: the turn is then encoded whole
                self._error = e

    def _finish_fork(self) -> tuple[Any, Any]:
        if self._error is not None:
            raise self._error
        return self._stream.fork().finish()
