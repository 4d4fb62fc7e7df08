"""`Code2WavStream`: exact streaming Code2Wav on the host side, one stream or several in lock step, over
`Code2Wav.step` (or a replacement of it, e.g. CUDA graph replays): the samples of each pushed chunk that no
later frame can change, so the pushes concatenated equal the offline decode (`omni_rt.model.code2wav`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from omni_rt.errors import InvalidRequestError
from omni_rt.model.code2wav import Code2Wav, Code2WavState, check_codes


class Code2WavStream:
    """Exact streaming decode: the concatenation of `push` outputs equals `model(all codes)`.

        stream = Code2WavStream(model)
        pcm = stream.push(codes)        # codes [Q, n], any n >= 1 -> float32 [samples] on the model's device
        pcm = stream.flush()            # end of stream: the remaining samples (none; see below), then reset

    `batch_size > 1` decodes several streams in lock step: `push(codes [B, Q, n])` returns a list of B
    tensors (they differ in length only in a stream's first chunk); `reset(row)` restarts one stream.

    Each push emits every sample that no later frame can change: after N frames in all,
    `samples_per_frame * N - shortfall` samples (the first push of one frame gives 1920 - 555 = 1365 for
    the real model). The reference's offline decode ends at exactly that sample, so `flush()` has
    nothing left to emit; it returns an empty tensor and resets the stream for the next utterance.
    """

    def __init__(
        self,
        model: Code2Wav,
        batch_size: int = 1,
        step: Callable[[torch.Tensor, Code2WavState], torch.Tensor] | None = None,
        state: Code2WavState | None = None,
    ) -> None:
        """`step` replaces `model.step` (same signature), e.g. by replays of CUDA graphs per chunk size;
        `state` is where the streams' state lives (`batch_size` streams; default: a new one)."""
        if batch_size < 1:
            raise InvalidRequestError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.batch_size = batch_size
        self.step = step or model.step
        self.state = model.new_state(batch_size) if state is None else state
        self.frames = [0] * batch_size  # host copy of state.pos, for slicing off the pre-start samples

    @property
    def samples_per_frame(self) -> int:
        return self.model.samples_per_frame

    @property
    def shortfall(self) -> int:
        return self.model.shortfall

    def reset(self, row: int | None = None) -> None:
        self.state.reset(row)
        for b in range(self.batch_size) if row is None else (row,):
            self.frames[b] = 0

    @torch.no_grad()
    def push(self, codes: torch.Tensor, check: bool = True) -> torch.Tensor | list[torch.Tensor]:
        """Decode the next n frames of each stream: codes [Q, n] (one stream) or [B, Q, n].

        Returns float32 PCM on the model's device: [samples] for [Q, n] codes, else a list of B.
        `check=False` skips the code range check (a host sync when the codes are on the GPU); codes out
        of range then fail inside the embedding lookup. Rejected input leaves the stream unchanged."""
        cfg = self.model.cfg
        single = isinstance(codes, torch.Tensor) and codes.dim() == 2
        check_codes(codes, cfg, "pushed codes", values=check)
        if single:
            if self.batch_size != 1:
                raise InvalidRequestError(
                    f"this stream decodes {self.batch_size} streams: push [B, Q, n] codes"
                )
            codes = codes[None]
        elif codes.dim() != 3 or codes.shape[0] != self.batch_size:
            raise InvalidRequestError(
                f"pushed codes must be [{cfg.num_quantizers}, n] or [{self.batch_size}, "
                f"{cfg.num_quantizers}, n], got shape {tuple(codes.shape)}"
            )
        n = codes.shape[-1]
        # a copy: a graph-replaying `step` returns its static output buffer, which the next replay reuses
        wav = self.step(codes.to(self.state.pos.device), self.state)[:, 0].to(torch.float32, copy=True)
        out = [self.take(b, wav[b], n) for b in range(self.batch_size)]
        return out[0] if single else out

    def take(self, row: int, wav: torch.Tensor, n: int) -> torch.Tensor:
        """Stream `row`'s PCM of a decoded chunk of `n` frames (`wav`: the step's samples for that row),
        and count the frames: the samples before the stream's first one (its first chunk only) are not
        part of the decode. For a caller that steps this stream's state itself (batched with others)."""
        skip = max(self.shortfall - self.samples_per_frame * self.frames[row], 0)
        self.frames[row] += n
        return wav[skip:]

    def flush(self) -> torch.Tensor | list[torch.Tensor]:
        """End every stream: return what is left (nothing: see the class doc) and reset for reuse."""
        empty = torch.zeros(0, dtype=torch.float32, device=self.state.pos.device)
        self.reset()
        return empty if self.batch_size == 1 else [empty.clone() for _ in range(self.batch_size)]
