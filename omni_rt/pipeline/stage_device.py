"""What the stage runners share on the device side: host ids onto the device without a sync, each
stage's own CUDA stream, the wrapper every runner method runs in, the one read-back per step, the
gate that orders the Thinker's and the Talker's prefill launches, and the values a response's start
hands from stage to stage on the device (`StartHandoff`).
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Sequence
from contextlib import nullcontext

import numpy as np
import torch

from omni_rt.model.device_ids import to_device  # the runners' way too: one place
from omni_rt.pipeline.request import Request

__all__ = [
    "DeviceHandoff",
    "LaunchGate",
    "StageActivity",
    "StartHandoff",
    "StepInputs",
    "host_ids",
    "kept",
    "row_groups",
    "stage_call",
    "stage_stream",
    "to_device",
    "to_host",
]


_stage_streams: weakref.WeakValueDictionary[tuple[int, int], torch.cuda.Stream] = (
    weakref.WeakValueDictionary()
)


def stage_stream(device: torch.device, priority: int) -> torch.cuda.Stream | None:
    """A stage's own CUDA stream (None on the CPU). Every stage runs off the legacy default stream,
    which would serialise them; the Talker and Code2Wav get high priority, so that the Thinker's
    weight streaming does not starve the small steps on the path to the first audio.

    Never a live stage's stream: PyTorch hands out streams from a pool of 32 per priority, and a stage's
    graphs are captured on its stream, which keys their cuBLAS workspace (graphs.py): two stages on one
    stream would share it while their threads replay at once."""
    if device.type != "cuda":
        return None
    for _ in range(64):  # the pool is round-robin: a few draws pass any live stage's stream
        stream = torch.cuda.Stream(device=device, priority=priority)
        key = (stream.device_index, stream.cuda_stream)
        if key not in _stage_streams:
            _stage_streams[key] = stream
            return stream
    raise RuntimeError(f"no CUDA stream free of other stages on {device} (priority {priority})")


def stage_call(fn):
    """A runner method: no autograd, on the runner's stream (`self.stream`) when it has one.

    On the CPU in inference mode, which also skips the version counters and view tracking of every op: the
    tiny preset's steps are hundreds of small ops, and its stage threads share one interpreter lock with
    the server's event loop (RTF 0.80 -> 0.64-0.72 side by side, docs/performance.md)."""

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        grad = torch.inference_mode() if self.stream is None else torch.no_grad()
        with grad, torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            return fn(self, *args, **kwargs)

    return call


def row_groups(n: int, deterministic: bool) -> list[slice]:
    """Row groups to run: the whole batch, or one row at a time (batch-invariant) when deterministic."""
    return [slice(i, i + 1) for i in range(n)] if deterministic else [slice(0, n)]


def host_ids(choices: list[torch.Tensor], pinned: bool = False) -> list:
    """Ids chosen on the device ([b] or [b, k] each, one per row group), read back in one host sync:
    every group's step is enqueued before the host waits, so a step pays one device round trip, not one
    per group. Each must be a copy (`kept`) when a later group replays the graph that made it. `pinned`:
    as `to_host`'s."""
    ids = torch.cat(choices)
    return (to_host(ids, pinned) if pinned else ids).tolist()


def to_host(t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """`t`'s values in host memory of their own, once the work queued before on the current stream is
    done. `pinned` (`EngineSettings.pinned_readback`, on a GPU): a copy queued into pinned memory and a
    wait on an event recorded after it, instead of a blocking copy into pageable memory, which may hold
    the driver's lock while it waits for the stream (what `scripts/gpu_launch_lock.py` measures); the
    values then leave the pinned block, which goes back to PyTorch's cache at once (a session may keep
    PCM for seconds)."""
    if not pinned or t.device.type != "cuda":
        return t.to("cpu", copy=True)
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    staged.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return staged.clone()


class StepInputs:
    """A graphed step's integer inputs, filled from the host in one copy. `tensors` are views of one
    device buffer, and the step's graphs are captured over them, so a replay copies no input; the host
    writes them, padding rows included, into one pinned buffer, copied over in one call.

    Why: fed as separate tensors, each input of a step cost a pinned staging, a copy, a padding kernel
    and a copy into the graph's own input: ~30 driver calls a Talker step and its frame, each taking the
    driver's lock, which another stage thread's graph launch holds for up to ~3 ms (docs/performance.md,
    2026-12-04 third session). `fill` waits for the previous copy only when no read-back has followed it
    (`read_back`), so the pinned buffer is never rewritten under a copy still queued."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], pads: Sequence[int], device: torch.device) -> None:
        sizes = [math.prod(shape) for shape in shapes]
        total = sum(sizes)
        cuda = device.type == "cuda"
        self._device = torch.empty(total, dtype=torch.long, device=device)
        self._host = torch.empty(total, dtype=torch.long, pin_memory=cuda)
        self.tensors: tuple[torch.Tensor, ...] = ()
        self._rows: list = []  # per input, its host rows (numpy views of the pinned buffer)
        start = 0
        for shape, size in zip(shapes, sizes, strict=True):
            self.tensors += (self._device[start : start + size].view(shape),)
            self._rows.append(self._host[start : start + size].numpy().reshape(shape[0], -1))
            start += size
        self._pads = list(pads)
        self._queued: torch.cuda.Stream | None = None  # the stream of a copy no read-back has followed
        self.fill([[] for _ in shapes])  # every row padding: what a graph's capture reads
        if self._queued is not None:  # before a capture on another stream reads them
            self._queued.synchronize()
            self._queued = None

    def fill(self, values: Sequence[Sequence]) -> tuple[torch.Tensor, ...]:
        """Input i's first len(values[i]) rows (each an int, or a row of ints, flattened in the input's
        order) from values[i], the rest its pad; one copy to the device, queued on the current stream.
        -> `tensors`."""
        if self._queued is not None:  # a copy from the pinned buffer may not have run yet
            self._queued.synchronize()
        for rows, given, pad in zip(self._rows, values, self._pads, strict=True):
            n = len(given)
            if n:
                rows[:n] = np.asarray(given, dtype=np.int64).reshape(n, -1)
            rows[n:] = pad
        cuda = self._device.device.type == "cuda"
        self._device.copy_(self._host, non_blocking=cuda)
        self._queued = torch.cuda.current_stream(self._device.device) if cuda else None
        return self.tensors

    def read_back(self) -> None:
        """A host sync on the copy's stream came after it (the step's read-back): the pinned buffer is
        free."""
        self._queued = None


def kept(out: torch.Tensor) -> torch.Tensor:
    """A copy of a step's output (a graph's output buffer is overwritten by its next replay)."""
    return out.clone()


class LaunchGate:
    """Which requests have their Thinker prefill enqueued on the GPU; the Talker's prefix waits for it.

    With `talker_overlap_prefill` the scheduler hands the Talker its prefix at admission, so both stage
    threads prepare and launch their prefills at the same moment and contend for the GIL and the launch
    queue: in eager mode the Thinker's 57-token prefill went from 70 ms alone to 180 ms with the Talker's
    prefix launching beside it (docs/performance.md). The Thinker prefill is on the path to the first
    token and the prefix is not (it is needed only at the first token), so the Talker waits here until
    the Thinker's prefill is enqueued; then it builds and launches its prefix on its own high-priority
    stream. Reasoning, not measured: with both graphed, each prefill is one launch from its thread, so
    there is no GIL or launch-queue fight left; on the GPU the Thinker's prefill is a chain of small
    kernels that leaves most SMs idle, and the prefix's kernels fill them. High priority lets the
    prefix's blocks go first when both have blocks ready, so it can delay the Thinker by at most its
    own GPU time (a graphed 20-layer Talker prefill of ~40 positions: a few ms, against the ~110 ms
    the eager fight cost), and it is done before the first token needs it. A low-priority prefix would
    cost the Thinker nothing, but the prefix shares the Talker's stream with the last prompt position
    and every frame, which must stay high priority. The wait is bounded (`timeout_s`) because the
    Talker thread also serves other sessions' frames.
    """

    def __init__(self, timeout_s: float = 0.02) -> None:
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._launched: weakref.WeakSet[Request] = weakref.WeakSet()  # a done request needs no cleanup

    def open(self, reqs: list[Request]) -> None:
        with self._cond:
            self._launched.update(reqs)
            self._cond.notify_all()

    def wait(self, reqs: list[Request]) -> bool:
        """Block until the Thinker prefills of all `reqs` are enqueued (True) or the timeout passes
        (False): one timeout for them all, so a batch of prefixes waits no longer than one."""
        with self._cond:
            return self._cond.wait_for(lambda: all(r in self._launched for r in reqs), self.timeout_s)


class StageActivity:
    """Whether a stage may have work on the GPU, as its own thread knows it without asking the driver (an
    event query is a driver call, which waits while another thread's graph launch holds the driver's lock:
    `StepInputs`): busy from the start of a device call (`begin`) to a read-back that waited for all of its
    stream's work (`synced`). A call that returns with work still queued (a prefill piece) leaves it busy.

    The Thinker's runner writes it, the Talker's reads it (`EngineSettings.programmatic_launch` 'idle':
    code-predictor frames take programmatic launches only while the Thinker has nothing on the GPU, where
    their early-started programs cannot take SMs from its kernels). One writer thread; a reader sees a
    bool, and a frame launched just before the Thinker's next step overlaps it for one frame at most."""

    def __init__(self) -> None:
        self.busy = False

    def begin(self) -> None:
        self.busy = True

    def synced(self) -> None:
        self.busy = False


class DeviceHandoff:
    """Per-slot ids one stage leaves on the device for another stage's next launch, with no host round trip
    between them: the producer writes its slots' rows on its stream and records an event after (`publish`
    -> that event; None off the GPU, where a stage call is done when it returns); the consumer's stream
    waits for the event, then reads the rows (`read`). A slot's row is written once per response, at its
    start, and read before that response ends, so a read never races the next write."""

    def __init__(self, slots: int, width: int, device: torch.device) -> None:
        self.values = torch.zeros(slots, width, dtype=torch.long, device=device)

    def publish(self, slots: torch.Tensor, values: torch.Tensor) -> torch.cuda.Event | None:
        """On the current stream (the producer's): rows `slots` [B] = values [B] or [B, width]."""
        self.values.index_copy_(0, slots, values.reshape(slots.shape[0], -1))
        if self.values.device.type != "cuda":
            return None
        ready = torch.cuda.Event()
        ready.record()
        return ready

    def read(self, slots: torch.Tensor, ready: torch.cuda.Event | None) -> torch.Tensor:
        """On the current stream (the consumer's), after `ready`: rows `slots` [B] -> [B, width]."""
        if ready is not None:
            torch.cuda.current_stream(self.values.device).wait_event(ready)
        return self.values.index_select(0, slots)


class StartHandoff:
    """What a response's start hands on the device from stage to stage (`EngineSettings.early_start`): the
    Thinker's first reply id to the Talker, and the Talker's frame 0 to Code2Wav. One per engine, shared
    by its three runners (`runners.build_runners`)."""

    def __init__(self, slots: int, code_groups: int, device: torch.device) -> None:
        self.first_token = DeviceHandoff(slots, 1, device)
        self.frame0 = DeviceHandoff(slots, code_groups, device)
