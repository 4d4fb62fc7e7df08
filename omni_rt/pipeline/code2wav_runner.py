"""Code2Wav's device side: one exact streaming decoder state per session slot, the graphs that decode
chunks of one or several streams, and the calls the scheduler's Code2Wav thread makes (`pipeline/
code2wav.py` decides which chunks go in a call)."""

from __future__ import annotations

import numpy as np
import torch

from omni_rt.config import EngineSettings
from omni_rt.model.code2wav_stream import Code2WavStream
from omni_rt.pipeline import graphs
from omni_rt.pipeline.graphs import GraphPool
from omni_rt.pipeline.request import Request
from omni_rt.pipeline.shapes import code2wav_buckets
from omni_rt.pipeline.stage_device import (
    StartHandoff,
    StepInputs,
    stage_call,
    stage_stream,
    to_device,
    to_host,
)

__all__ = ["Code2WavRunner"]


class Code2WavRunner:
    """One exact streaming decoder state per session slot, all in one pool (`Code2WavState`, a stream a
    slot, plus a scratch stream for padding rows). A call loads the slots' streams into a work state
    (`gather`), decodes it, and stores them back (`scatter`): with graphs, one CUDA graph per (rows, chunk
    size) does all three, reading which slots from a static index, so the graphs need not be captured per
    slot and the host makes no copy of its own. (Copied by the host, 24 tensors a row each way, a call of
    18 rows was ~860 device-to-device `cudaMemcpyAsync` calls, each waiting for the driver's lock while
    the other stages launched their graphs: at 64 conversations on an H200 most of a call's 16 ms mean,
    against 3.5 ms on the GPU; docs/performance.md, 2026-12-04 third session.)

    Several responses' next chunks decode in one batched call (`push_many`, with `code2wav_batch`), each
    row exactly its own stream's decode: chunks of different sizes too, each row padded to the longest
    (ragged: `Code2WavState.valid`), its padding leaving no trace in its stream."""

    def __init__(self, model, settings: EngineSettings, start: StartHandoff | None = None) -> None:
        self.code2wav = model.code2wav
        self.device = model.device
        self.samples_per_frame = self.code2wav.samples_per_frame
        self.stream = stage_stream(self.device, priority=-1)
        self.pinned = settings.pinned_readback
        self._graphs: dict[tuple[int, int], object] = {}  # (rows bucket, chunk frames) -> captured decode
        # (rows bucket, chunk frames) -> that graph's codes, index and counts in one copy (StepInputs)
        self._inputs: dict[tuple[int, int], StepInputs] = {}
        self._filled: list[StepInputs] = []  # filled since this runner's last read-back
        self._work: dict[int, object] = {}  # rows bucket -> the work state its graphs decode
        self.scratch = settings.max_sessions  # the pool's stream for rows that pad a batch
        self._pool = self.code2wav.new_state(settings.max_sessions + 1)
        self._eager_one = None  # the work state of one-stream calls without a graph
        # slots whose stream is as `reset` leaves it (nothing decoded since): `open` has nothing to do,
        # so a response's first chunk, on the path to its first audio, waits for no reset
        self._fresh = set(range(settings.max_sessions))
        # early_start: frames 0 from the Talker on the device (shared by the engine's runners); each slot's
        # frame 0 decoded by `queue_first` for its request: (request, PCM on the device, its codes)
        self.start = start or StartHandoff(settings.max_sessions + 1, model.cfg.num_code_groups, self.device)
        self._queued: dict[int, tuple[Request, torch.Tensor, torch.Tensor]] = {}
        self._rows = code2wav_buckets(settings.max_sessions if settings.code2wav_batched else 1)
        self._sizes: list[int] = []  # chunk sizes with a graph, ascending
        if graphs.graphs_on(settings, self.device):
            self._sizes = sorted(settings.chunk_sizes())
            self._capture_all(self._sizes)
        # one exact streaming state per session slot: its row of the pool
        self._streams = [
            Code2WavStream(self.code2wav, step=lambda codes, _, slot=slot: self._decode(codes, [slot]), state=self._pool.row(slot))
            for slot in range(settings.max_sessions)
        ]  # fmt: skip

    @torch.no_grad()
    def _capture_all(self, chunk_sizes: list[int]) -> None:
        pool = GraphPool(self.stream)  # captured where they replay: graphs.py
        q = self.code2wav.cfg.num_quantizers
        for b in self._rows:
            work = self._work[b] = self.code2wav.new_state(b)
            for n in chunk_sizes:
                # codes [b, Q, n], the pool streams to decode [b] (padding rows: the scratch stream), and
                # each row's own frames [b] (a call of several rows may be ragged; one stream's never is):
                # the graph's own, filled in one copy; the work state between calls is the bucket's
                inputs = self._inputs[(b, n)] = StepInputs(
                    [(b, q, n), (b,), (b,)], [0, self.scratch, 0], self.device
                )
                codes, index, valid = inputs.tensors
                own = valid if b > 1 else None
                self._graphs[(b, n)] = graphs.capture_or_eager(
                    lambda c, w=work, ix=index, v=own: self._pooled_step(c, w, ix, v), (codes,), pool
                )

    def _pooled_step(self, codes: torch.Tensor, work, index: torch.Tensor, valid: torch.Tensor | None):
        """The pool's streams `index` [B] each decode their row of codes [B, Q, n]: loaded into `work`,
        stepped, stored back. -> wav [B, 1, spf n]. `valid` [B]: the rows' own frames (None: all n), set on
        `work` here because the graphs of one rows bucket share it and each reads its own counts."""
        work.valid = valid
        work.gather(self._pool, index)
        wav = self.code2wav.step(codes, work)
        work.scatter(self._pool, index)
        return wav

    def _decode(
        self, codes: torch.Tensor, slots: list[int], valid: list[int] | None = None, host=None
    ) -> torch.Tensor:
        """One chunk of each of the slots' streams in one call: codes [B, Q, n] -> wav [B, 1, spf n],
        each stream advanced as its own decode would. `valid`: each row's own frames (ragged:
        row i's chunk is codes[i, :, :valid[i]], its PCM the first spf valid[i] samples); None: all n.
        A graphed (rows bucket, size) loads the slots' streams and the scratch stream for its padding
        rows from the pool, decodes, and stores them back (`_pooled_step`, captured); without a graph
        the same, eagerly (the last chunk of a response can have any size)."""
        rows, n = codes.shape[0], codes.shape[-1]
        self._fresh.difference_update(slots)  # before the call: one that fails may have written some
        if rows == 1 and valid is not None:  # one stream: its own frames, never ragged
            codes, n, valid, host = codes[..., : valid[0]], valid[0], None, None
        b = self._bucket(rows)
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
            head = self._decode(codes[..., :m], slots, head_valid).clone()
            return torch.cat([head, self._decode(codes[..., m:], slots, tail_valid)], dim=-1)
        own = [n] * rows if valid is None else valid  # each row's own frames
        if graph is not None:
            # the graph's codes, index and counts in one copy: the codes from the host when the caller
            # has them there (`host`, [rows, Q n]), else copied over on the device (a stream's push)
            inputs = self._inputs[(b, n)]
            static = inputs.fill([[] if host is None else host, slots, own])
            if host is None:
                static[0][:rows].copy_(codes, non_blocking=True)
            self._filled.append(inputs)
            return graph(static[0])[:rows]
        if rows == 1:  # the one-stream work state, kept (on the CPU every call is eager)
            if self._eager_one is None:
                self._eager_one = self.code2wav.new_state(1)
            work = self._eager_one
        else:  # a fresh one (kept for every row count, at real shapes they would hold GBs)
            work = self.code2wav.new_state(rows)
            work.valid = torch.zeros(rows, dtype=torch.long, device=self.device)
        padded = slots + [self.scratch] * (work.pos.shape[0] - rows)
        if work.valid is not None:
            work.valid.copy_(to_device(own + [0] * (work.valid.shape[0] - rows), self.device))
        return self._pooled_step(codes, work, to_device(padded, self.device), work.valid)

    def _bucket(self, rows: int) -> int | None:
        """The rows bucket a call of `rows` streams runs at (None: above every bucket)."""
        return next((r for r in self._rows if r >= rows), None)

    def _read_back(self) -> None:
        """A read-back of this runner's stream came after the inputs filled since the last: their pinned
        buffers are free (`StepInputs.read_back`)."""
        for inputs in self._filled:
            inputs.read_back()
        self._filled.clear()

    @stage_call  # a reset writes the slot's device state: in stream order with the pushes around it
    def open(self, req: Request) -> None:
        if req.slot not in self._fresh:
            self._reset(req.slot)

    def _reset(self, slot: int) -> None:
        self._streams[slot].reset()
        self._fresh.add(slot)

    @stage_call
    def queue_first(self, req: Request, ready: object) -> None:
        """`early_start`: open the request's stream and decode its frame 0, read on the device after
        `ready` (the Talker's `queue_last`), before the host has it; its first `push` reads the PCM back."""
        self.open(req)
        slot = to_device([req.slot], self.device)
        codes = self.start.frame0.read(slot, ready)  # [1, 16]
        # the Talker's codes are in range by construction: skip the check (a host sync on the GPU)
        self._queued[req.slot] = (req, self._streams[req.slot].push(codes.T, check=False), codes[0])

    def _queued_heads(self, reqs: list[Request], frames: list[list[list[int]]]) -> dict[Request, np.ndarray]:
        """The PCM of each request's frame 0 that `queue_first` decoded (a chunk starting at frame 0 whose
        codes are the ones decoded; those of another chunk, or of other codes, are dropped, the stream then
        starting afresh, so a chunk always decodes exactly)."""
        heads = {}
        for r, f in zip(reqs, frames, strict=True):
            req, pcm, codes = self._queued.pop(r.slot, (None, None, None))
            if req is not r:
                continue
            if self._streams[r.slot].frames[0] == 1:
                pcm = to_host(pcm.float(), self.pinned)  # waits for frame 0's decode; its codes are there too
                if to_host(codes, self.pinned).tolist() == f[0]:
                    heads[r] = pcm.numpy()
                    continue
            self._reset(
                r.slot
            )  # not this chunk's frame 0 (cannot happen: the Talker's frame 0 is what it decoded)
        return heads

    @stage_call
    def push(self, req: Request, frames: list[list[int]]) -> np.ndarray:
        return self._push_many([req], [frames])[0]

    @stage_call
    def push_many(self, reqs: list[Request], frames: list[list[list[int]]]) -> list[np.ndarray]:
        """The next chunk of each request (of any sizes) in one call: PCM per request, each exactly what
        `push` gives it alone (up to float rounding of a batched kernel on a GPU)."""
        if len(reqs) == 1:
            return [self.push(reqs[0], frames[0])]
        return self._push_many(reqs, frames)

    def _push_many(self, reqs: list[Request], frames: list[list[list[int]]]) -> list[np.ndarray]:
        """`push_many`: a frame 0 that `queue_first` decoded is read back, and the chunk's other frames
        decoded after it."""
        heads = self._queued_heads(reqs, frames) if self._queued else {}
        if not heads:
            return self._decode_chunks(reqs, frames)
        rest = [f[1:] if r in heads else f for r, f in zip(reqs, frames, strict=True)]
        todo = [i for i, f in enumerate(rest) if f]
        pcms = [np.zeros(0, np.float32) for _ in reqs]
        for i, pcm in zip(
            todo, self._decode_chunks([reqs[i] for i in todo], [rest[i] for i in todo]), strict=True
        ):
            pcms[i] = pcm
        return [np.concatenate([heads[r], p]) if r in heads else p for r, p in zip(reqs, pcms, strict=True)]

    def _decode_chunks(self, reqs: list[Request], frames: list[list[list[int]]]) -> list[np.ndarray]:
        """`push_many` of chunks with frames to decode (none: nothing)."""
        if not reqs:
            return []
        if len(reqs) == 1:
            codes = to_device(frames[0], self.device).T  # [16, n]
            # the Talker's codes are in range by construction: skip the check (a host sync on the GPU)
            pcm = self._streams[reqs[0].slot].push(codes, check=False)
            host = to_host(pcm.float(), self.pinned).numpy()
            self._read_back()
            return [host]
        sizes = [len(f) for f in frames]
        n, q = max(sizes), self.code2wav.cfg.num_quantizers
        padded = [f + [[0] * q] * (n - len(f)) for f in frames]  # any codes: the padding leaves no trace
        host = np.asarray(padded, dtype=np.int64).transpose(0, 2, 1)  # [B, 16, n]
        graphed = (self._bucket(len(reqs)), n) in self._graphs
        # a graph takes the codes in its one copy of inputs (StepInputs); otherwise they go over here
        codes = torch.from_numpy(host) if graphed else to_device(host, self.device)
        streams = [self._streams[r.slot] for r in reqs]
        # one copy to the host for all rows (not one read-back each), out of the graph's output buffer,
        # which the next replay overwrites
        out = self._decode(
            codes, [r.slot for r in reqs], sizes, host.reshape(len(reqs), -1) if graphed else None
        )
        wav = to_host(out[:, 0].float(), self.pinned)
        self._read_back()
        spf = self.samples_per_frame
        return [
            s.take(0, wav[i, : spf * k], k).numpy()
            for i, (s, k) in enumerate(zip(streams, sizes, strict=True))
        ]

    @stage_call
    def flush(self, req: Request) -> np.ndarray:
        pcm = to_host(self._streams[req.slot].flush().float(), self.pinned).numpy()  # (and a fresh stream)
        self._fresh.add(req.slot)
        return pcm

    @stage_call
    def close(self, req: Request) -> None:
        self._reset(req.slot)
