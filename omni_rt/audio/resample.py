"""Streaming rational resampler: 24 kHz model audio to 48 kHz (WebRTC) or 16 kHz, chunk by chunk.

A polyphase windowed-sinc FIR. The resampler keeps the last input samples the filter still needs between
calls, so the concatenation of `push()` outputs plus `flush()` equals resampling the whole signal at once:
there are no clicks at chunk seams, whatever the chunk sizes.

Output sample n is the band-limited signal at time n / out_rate (zero delay, centred filter): it needs
`half_taps` input samples of look-ahead, which `push()` holds back until they arrive and `flush()` fills
with silence at the end of the stream.
"""

from __future__ import annotations

from math import gcd

import numpy as np

__all__ = ["StreamingResampler", "resample"]


def _design(up: int, down: int, half_taps: int, beta: float) -> np.ndarray:
    """Polyphase table [up, 2*half_taps + 1] of a Kaiser-windowed sinc low-pass at the upsampled rate."""
    # Cut at the lower Nyquist of the two rates, a little inside it so the transition band stays below.
    cutoff = 0.95 / max(up, down)  # fraction of the upsampled Nyquist
    n = 2 * up * half_taps + 1  # prototype length, odd: centred at up*half_taps
    t = np.arange(n) - up * half_taps
    h = cutoff * np.sinc(cutoff * t) * np.kaiser(n, beta)
    h *= up / h.sum()  # unit DC gain after zero-stuffing by `up`
    taps = 2 * half_taps + 1
    table = np.zeros((up, taps))
    for phase in range(up):
        row = h[phase::up]
        table[phase, : len(row)] = row
    return table


class StreamingResampler:
    """Resample a mono float stream from `in_rate` to `out_rate` (any integer rates), incrementally."""

    def __init__(self, in_rate: int, out_rate: int, half_taps: int = 16, beta: float = 8.0):
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {in_rate} -> {out_rate}")
        g = gcd(in_rate, out_rate)
        self.in_rate, self.out_rate = in_rate, out_rate
        self.up, self.down = out_rate // g, in_rate // g
        self.half_taps = half_taps
        self._table = _design(self.up, self.down, half_taps, beta)  # [up, taps]
        self._taps = self._table.shape[1]
        self._delay = self.up * half_taps  # centre of the prototype, in upsampled samples
        # Input history: _buf[0] is input sample number _buf_start; silence before the stream starts.
        self._buf = np.zeros(self._taps, dtype=np.float64)
        self._buf_start = -self._taps
        self._n_in = 0  # input samples received
        self._n_out = 0  # output samples produced
        self._flushed = False

    @property
    def passthrough(self) -> bool:
        return self.up == self.down

    def _last_input_needed(self, n: np.ndarray) -> np.ndarray:
        """Index of the newest input sample output n reads (its window runs back `taps` samples)."""
        return (n * self.down + self._delay) // self.up

    def _emit(self, n_end: int) -> np.ndarray:
        """Outputs [self._n_out, n_end), all of whose inputs are in the buffer (zeros past the end)."""
        n = np.arange(self._n_out, n_end)
        if len(n) == 0:
            return np.zeros(0, dtype=np.float32)
        t = n * self.down + self._delay  # upsampled time of each output
        last = t // self.up  # newest input index in the window
        phase = t - last * self.up  # which polyphase row
        # window[j] = x[last - j] for j in 0..taps-1, gathered from the buffer: [n, taps]
        idx = (last - self._buf_start)[:, None] - np.arange(self._taps)[None, :]
        y = np.einsum("nj,nj->n", self._table[phase], self._buf[idx])
        self._n_out = n_end
        return y.astype(np.float32)

    def _trim(self) -> None:
        # Keep only what the next output's window can still read.
        oldest = int(self._last_input_needed(np.array(self._n_out))) - self._taps + 1
        drop = oldest - self._buf_start
        if drop > 0:
            self._buf = self._buf[drop:]
            self._buf_start += drop

    def push(self, x: np.ndarray) -> np.ndarray:
        """Feed float samples; returns every output sample whose input window is now complete."""
        if self._flushed:
            raise RuntimeError("push() after flush(): make a new resampler per stream")
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        if self.passthrough:
            self._n_in += len(x)
            self._n_out += len(x)
            return x.astype(np.float32)
        self._buf = np.concatenate([self._buf, x])
        self._n_in += len(x)
        # outputs n with last_input_needed(n) <= n_in - 1
        n_end = ((self._n_in - 1) * self.up - self._delay) // self.down + 1
        n_end = max(n_end, self._n_out)
        y = self._emit(n_end)
        self._trim()
        return y

    def flush(self) -> np.ndarray:
        """End of stream: the remaining outputs (ceil(n_in * out/in) in all), with silence as look-ahead."""
        if self._flushed:
            return np.zeros(0, dtype=np.float32)
        self._flushed = True
        total = -(-self._n_in * self.up // self.down)
        if self.passthrough or total <= self._n_out:
            return np.zeros(0, dtype=np.float32)
        self._buf = np.concatenate([self._buf, np.zeros(self._taps + 1)])
        return self._emit(total)


def resample(x: np.ndarray, in_rate: int, out_rate: int) -> np.ndarray:
    """One-shot resampling of a whole signal (the same filter as the streaming one)."""
    r = StreamingResampler(in_rate, out_rate)
    return np.concatenate([r.push(x), r.flush()])
