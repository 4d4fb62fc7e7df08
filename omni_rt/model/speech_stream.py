"""A user turn encoded while it is spoken: log-mel frames and audio-encoder windows as the audio arrives,
so the end of the turn leaves only the last window and the prefill. The result is the whole-turn
encoding (`log_mel` then `AudioEncoder.encode`), within float rounding.

    stream = SpeechStream(encoder)          # one per turn
    stream.push(audio_16k)                  # any chunk sizes, while the user speaks
    feats, tokens = stream.finish()         # [128, T], [audio_token_count(T), output_dim]

What is final when:
- a mel frame, once the 200 samples after its centre have arrived (its window is whole); the first
  frames see the clip's start reflected, as the centred STFT does, and the last ones, computed in
  `finish`, its end. Its log power is final then; the floor (8 below the clip's loudest bin) is not,
  since a louder bin may still come.
- a conv window of 2·n_window frames, once its frames are: it is encoded with the floor known so far,
  and `finish` encodes it again only if the final floor changes any of its features (speech reaches
  its loudest early, so this is rare).
- an attention block, once all its windows are (and, at `finish`, still are) final.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch.nn import functional as F

from omni_rt.audio.features import HOP_LENGTH, N_FFT, SAMPLE_RATE, floor_log_mel, log_mel, raw_log_mel
from omni_rt.errors import InvalidRequestError
from omni_rt.model.audio_encoder import AudioEncoder

__all__ = ["SpeechStream"]

HALF = N_FFT // 2


class SpeechStream:
    """One turn's features and encoder tokens, computed as its audio arrives (see the module doc)."""

    def __init__(self, encoder: AudioEncoder) -> None:
        self.encoder = encoder
        self._device = encoder.proj2.weight.device  # features are made on the CPU, encoded there
        self.win = 2 * encoder.cfg.n_window
        self.block_windows = encoder.cfg.n_window_infer // self.win
        self._pieces: list[np.ndarray] = []  # pushed audio not yet joined onto `_joined`
        self._joined = np.zeros(0, np.float32)
        self._n = 0
        self._logs: list[torch.Tensor] = []  # raw log-mel frames [M, k], in order
        self._frames = 0  # raw frames computed
        self._peak = -float("inf")
        self._windows: list[tuple[torch.Tensor, torch.Tensor]] = []  # (features used, conv tokens)
        self._blocks: list[torch.Tensor] = []  # encoded attention blocks [block, output_dim]

    @property
    def samples(self) -> int:
        return self._n

    @property
    def _audio(self) -> np.ndarray:
        if self._pieces:  # joined only when frames are computed (once a window), not on every push
            self._joined = np.concatenate((self._joined, *self._pieces))
            self._pieces.clear()
        return self._joined

    def fork(self) -> SpeechStream:
        """A copy that finishes on its own: the turn so far, encoded as if it ended here (a speculative
        reply at a pause), while this one goes on if the user does. Shares the computed tensors, which
        neither changes."""
        other = copy.copy(self)
        other._pieces, other._logs = list(self._pieces), list(self._logs)
        other._windows, other._blocks = list(self._windows), list(self._blocks)
        return other

    def push(self, audio: np.ndarray) -> None:
        a = np.asarray(audio)
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.floating) or not np.isfinite(a).all():
            raise InvalidRequestError("speech input must be finite float mono PCM at 16 kHz")
        self._pieces.append(a.astype(np.float32))
        self._n += len(a)
        n = self._n
        if n <= HALF:  # the start's reflection needs the first 201 samples
            return
        final = min((n - HALF) // HOP_LENGTH + 1, n // HOP_LENGTH)  # frames whose window has arrived
        # Frames are computed a conv window at a time: the encoder needs no earlier, and each call
        # into torch costs more than the few frames a 20 ms push completes.
        if final // self.win > len(self._windows):
            with torch.inference_mode():
                self._add_frames(final)
                self._encode_ready()

    def _add_frames(self, upto: int) -> None:
        """Raw frames [self._frames, upto) from the audio so far (no right padding: they do not reach it)."""
        lo = self._frames * HOP_LENGTH - HALF  # sample index of frame `_frames`' window start
        if lo < 0:
            head = torch.from_numpy(self._audio[: upto * HOP_LENGTH + HALF])
            seg = F.pad(head[None, None], (HALF, 0), mode="reflect")[0, 0]
            seg = seg[self._frames * HOP_LENGTH :]
        else:
            seg = torch.from_numpy(self._audio[lo : (upto - 1) * HOP_LENGTH + HALF])
        logs = raw_log_mel(seg[None])[0][:, : upto - self._frames]
        self._logs.append(logs)
        self._frames = upto
        self._peak = max(self._peak, float(logs.max()))

    def _features(self, upto: int) -> torch.Tensor:
        logs = torch.cat(self._logs, dim=1)[:, :upto]
        return floor_log_mel(logs, self._peak)

    def _encode_ready(self) -> None:
        whole = self._frames // self.win
        if whole <= len(self._windows):
            return
        feats = self._features(whole * self.win)
        for w in range(len(self._windows), whole):
            chunk = feats[:, w * self.win : (w + 1) * self.win]
            self._windows.append((chunk, self.encoder.conv_tokens([chunk.T.to(self._device)])))
        block = self.encoder.block_tokens(self.win)
        while (len(self._blocks) + 1) * self.block_windows <= len(self._windows):
            b = len(self._blocks)
            tokens = torch.cat(
                [t for _, t in self._windows[b * self.block_windows : (b + 1) * self.block_windows]]
            )
            self._blocks.append(self.encoder.attend(tokens, [block]))

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [n_mels, T], tokens [audio_token_count(T), output_dim]) of the whole turn."""
        n = self._n
        if n < N_FFT:
            raise InvalidRequestError(f"a turn needs at least {N_FFT} samples at {SAMPLE_RATE} Hz, got {n}")
        with torch.inference_mode():
            total = n // HOP_LENGTH
            # the last frames, whose windows reach the end's reflection; the reflection needs more than
            # half a window of audio, so the tail may start a few (recomputed, dropped) frames earlier
            back = 0
            while n - (self._frames - back) * HOP_LENGTH + HALF <= HALF and back < self._frames:
                back += 1
            lo = (self._frames - back) * HOP_LENGTH - HALF
            if lo < 0:  # a turn this short is encoded whole
                feats = log_mel(self._audio)
                return feats, self.encoder.encode(feats.to(self._device))
            if total > self._frames:
                seg = F.pad(torch.from_numpy(self._audio[lo:])[None, None], (0, HALF), mode="reflect")[0, 0]
                logs = raw_log_mel(seg[None])[0][:, back : back + total - self._frames]
                self._logs.append(logs)
                self._frames = total
                self._peak = max(self._peak, float(logs.max()))
            feats = self._features(total)
            return feats, self._encode_rest(feats)

    def _encode_rest(self, feats: torch.Tensor) -> torch.Tensor:
        enc, win = self.encoder, self.win
        total = feats.shape[1]
        # windows encoded under an older floor that the final one changes are encoded again
        stale = next(
            (
                w
                for w, (used, _) in enumerate(self._windows)
                if not torch.equal(used, feats[:, w * win : (w + 1) * win])
            ),
            len(self._windows),
        )
        self._windows = self._windows[:stale]
        self._blocks = self._blocks[: stale // self.block_windows]
        done_windows = len(self._blocks) * self.block_windows
        # conv windows are independent: those still valid are reused, the rest (the last) encoded now
        cached = [t for _, t in self._windows[done_windows:]]
        start = len(self._windows) * win
        chunks = [feats[:, s : min(s + win, total)].T.to(self._device) for s in range(start, total, win)]
        longest = win if total >= win else total
        if chunks:
            cached.append(enc.conv_tokens(chunks, pad_to=longest))
        rest = torch.cat(cached) if cached else feats.new_zeros(0, enc.cfg.d_model, device=self._device)
        block = enc.block_tokens(longest)
        sizes = [block] * (rest.shape[0] // block) + (
            [rest.shape[0] % block] if rest.shape[0] % block else []
        )
        out = [*self._blocks]
        if sizes:
            out.append(enc.attend(rest, sizes))
        return torch.cat(out)
