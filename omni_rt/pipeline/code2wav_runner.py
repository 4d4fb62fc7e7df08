"""Code2Wav's device side: one exact streaming decoder state per session slot, the graphs that decode
chunks of one or several streams, and the calls the scheduler's Code2Wav thread makes (`pipeline/
code2wav.py` decides which chunks go in a call)."""

from __future__ import annotations

import numpy as np
import torch

from omni_rt.config import EngineSettings
from omni_rt.model.code2wav import copy_states
from omni_rt.model.code2wav_stream import Code2WavStream
from omni_rt.pipeline import graphs
from omni_rt.pipeline.graphs import GraphPool
from omni_rt.pipeline.request import Request
from omni_rt.pipeline.shapes import code2wav_buckets, pad_rows
from omni_rt.pipeline.stage_device import stage_call, stage_stream, to_device

__all__ = ["Code2WavRunner"]


class Code2WavRunner:
    """One exact streaming decoder state per session slot. With graphs, one CUDA graph per (rows, chunk
    size) decodes a shared work state: the slots' states are copied into its rows before the replay and
    out after it (one multi-tensor copy each way: a few MB a slot at real shapes), so the graphs need not
    be captured per slot. Several responses' next chunks decode in one batched call (`push_many`, with
    `code2wav_batch`), each row exactly its own stream's decode: chunks of different sizes too, each row
    padded to the longest (ragged: `Code2WavState.valid`), its padding leaving no trace in its stream."""

    def __init__(self, model, settings: EngineSettings) -> None:
        self.code2wav = model.code2wav
        self.device = model.device
        self.samples_per_frame = self.code2wav.samples_per_frame
        self.stream = stage_stream(self.device, priority=-1)
        self._graphs: dict[tuple[int, int], object] = {}  # (rows bucket, chunk frames) -> captured decode
        self._work: dict[int, object] = {}  # rows bucket -> the work state its graphs decode
        self._rows = code2wav_buckets(settings.max_sessions if settings.code2wav_batched else 1)
        self._sizes: list[int] = []  # chunk sizes with a graph, ascending
        if graphs.graphs_on(settings, self.device):
            self._sizes = sorted(settings.chunk_sizes())
            self._capture_all(self._sizes)
        # one exact streaming state per session slot, allocated once
        step = lambda codes, state: self._decode(codes, [state])  # noqa: E731 - one stream's chunk
        self._streams = [Code2WavStream(self.code2wav, step=step) for _ in range(settings.max_sessions)]

    @torch.no_grad()
    def _capture_all(self, chunk_sizes: list[int]) -> None:
        pool = GraphPool(self.stream)  # captured where they replay: graphs.py
        q = self.code2wav.cfg.num_quantizers
        for b in self._rows:
            work = self._work[b] = self.code2wav.new_state(b)
            if b > 1:  # a call of several rows may be ragged; one stream's call never is
                work.valid = torch.zeros(b, dtype=torch.long, device=self.device)
            for n in chunk_sizes:
                codes = torch.zeros(b, q, n, dtype=torch.long, device=self.device)  # [b, Q, n]
                self._graphs[(b, n)] = graphs.capture_or_eager(
                    lambda c, w=work: self.code2wav.step(c, w), (codes,), pool
                )

    def _decode(self, codes: torch.Tensor, states: list, valid: list[int] | None = None) -> torch.Tensor:
        """One chunk of each of len(states) streams in one call: codes [B, Q, n] -> wav [B, 1, spf n],
        each state advanced as its own stream's decode would. `valid`: each row's own frames (ragged:
        row i's chunk is codes[i, :, :valid[i]], its PCM the first spf valid[i] samples); None: all n.
        A graphed (rows bucket, size) replays over its work state's first B rows (padding rows' outputs
        and states are never read); else eager (the last chunk of a response can have any size)."""
        rows, n = codes.shape[0], codes.shape[-1]
        if rows == 1 and valid is not None:  # one stream: its own frames, never ragged
            codes, n, valid = codes[..., : valid[0]], valid[0], None
        b = next((r for r in self._rows if r >= rows), None)
        graph = self._graphs.get((b, n))
        if graph is None and b is not None and (sizes := [m for m in self._sizes if m < n]):
            # a size without a graph (a reply's last chunk): graphed pieces one after another, the PCM
            # exactly the chunk's as streaming is exact (eager, a step took ~10x a replay at real shapes);
            # each piece copied out of its graph's output buffer before the next replay. Ragged, a row's
            # own frames are a prefix of the pieces' (min(v, m), then v - m), so its PCM stays a prefix.
            m = sizes[-1]
            head_valid = tail_valid = None
            if valid is not None:
                head_valid, tail_valid = [min(v, m) for v in valid], [max(v - m, 0) for v in valid]
            head = self._decode(codes[..., :m], states, head_valid).clone()
            return torch.cat([head, self._decode(codes[..., m:], states, tail_valid)], dim=-1)
        if graph is None and rows == 1:
            return self.code2wav.step(codes, states[0])
        work = self._work[b] if graph is not None else self.code2wav.new_state(rows)
        if rows > 1 and work.valid is None:  # an eager call of several rows
            work.valid = torch.zeros(rows, dtype=torch.long, device=self.device)
        if work.valid is not None:  # (a one-row graph reads no counts: its stream's frames are all its own)
            own = [n] * rows if valid is None else valid
            work.valid.copy_(to_device(own + [0] * (work.valid.shape[0] - rows), self.device))
        copy_states([work.row(i) for i in range(rows)], states)
        wav = graph(pad_rows(codes, b, 0)) if graph is not None else self.code2wav.step(codes, work)
        copy_states(states, [work.row(i) for i in range(rows)])
        return wav[:rows]

    @stage_call  # a reset writes the slot's device state: in stream order with the pushes around it
    def open(self, req: Request) -> None:
        self._streams[req.slot].reset()

    @stage_call
    def push(self, req: Request, frames: list[list[int]]) -> np.ndarray:
        codes = to_device(frames, self.device).T  # [16, n]
        # the Talker's codes are in range by construction: skip the check (a host sync on the GPU)
        return self._streams[req.slot].push(codes, check=False).float().cpu().numpy()

    @stage_call
    def push_many(self, reqs: list[Request], frames: list[list[list[int]]]) -> list[np.ndarray]:
        """The next chunk of each request (of any sizes) in one call: PCM per request, each exactly what
        `push` gives it alone (up to float rounding of a batched kernel on a GPU)."""
        if len(reqs) == 1:
            return [self.push(reqs[0], frames[0])]
        sizes = [len(f) for f in frames]
        n, q = max(sizes), self.code2wav.cfg.num_quantizers
        padded = [f + [[0] * q] * (n - len(f)) for f in frames]  # any codes: the padding leaves no trace
        codes = to_device(padded, self.device).transpose(1, 2)  # [B, 16, n]
        streams = [self._streams[r.slot] for r in reqs]
        # one copy to the host for all rows (not one read-back each), out of the graph's output buffer,
        # which the next replay overwrites
        wav = self._decode(codes, [s.state for s in streams], sizes)[:, 0].float().to("cpu", copy=True)
        spf = self.samples_per_frame
        return [s.take(0, wav[i, : spf * k], k).numpy() for i, (s, k) in enumerate(zip(streams, sizes, strict=True))]

    @stage_call
    def flush(self, req: Request) -> np.ndarray:
        return self._streams[req.slot].flush().float().cpu().numpy()

    @stage_call
    def close(self, req: Request) -> None:
        self._streams[req.slot].reset()
