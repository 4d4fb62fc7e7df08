"""CUDA-graph capture of static-shape steps, in one place, with an eager switch.

    step = capture(decode_step, (ids, positions, slots), enabled=settings.cuda_graphs)
    logits = step(ids_now, positions_now, slots_now)   # copies into the static inputs, replays

A runner owns its step functions; this module only turns one into a replayable graph. `fn` must take
tensors of fixed shapes, make no host sync and allocate nothing that outlives the call (the model's
static KV caches are written in place, which a graph replays). Outputs are the graph's own static
tensors: a caller reads or copies them before the next replay of the same graph.

On the CPU, or with `enabled=False`, `capture` returns the eager function with the same calling
convention, so runners have one code path. Graphs of one runner share a memory pool (`GraphPool`), so
buckets (batch sizes, Code2Wav chunk sizes) cost the memory of the largest, not of their sum.

A runner's graphs are captured on the runner's own stream (`GraphPool.stream`, its stage stream), never
on a stream that another stage's graphs were captured on. PyTorch keys cuBLAS's workspace by (handle,
current stream), and a graph keeps the workspace address of its capture; our small-batch GEMMs are split-K
kernels that keep partial sums and fix-up state there. Captured on fresh pooled streams (32 per
priority, all from the loading thread), a Thinker graph and a Talker graph shared a workspace, and the
two stage threads replayed them at once: on an H200 results came out wrong and the device stopped, every
stage waiting on it (`scripts/gpu_graph_streams.py`; docs/performance.md, 2026-12-02 (evening)). Graphs
of one runner replay one after another on its one stream, so sharing a workspace among them is safe.

Capture runs `fn` `warmup` times eagerly on the static inputs first: a step that writes a KV cache
writes there at the static inputs' positions and slots. Capture at engine start, before any sequence
owns a slot (or point the static inputs at a scratch slot).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

Tensors = Sequence[torch.Tensor]


class GraphPool:
    """A memory pool shared by the graphs captured through it, and the stream they are captured on: one
    per runner, `stream` the runner's stage stream (where they replay; see the module's docstring)."""

    def __init__(self, stream: torch.cuda.Stream | None = None) -> None:
        self.handle = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
        self.stream = stream


class Graphed:
    """A captured step: `__call__(*inputs)` copies `inputs` into the static inputs and replays."""

    def __init__(
        self,
        fn: Callable[..., Any],
        static_inputs: Tensors,
        *,
        warmup: int = 2,
        pool: GraphPool | None = None,
        stream: torch.cuda.Stream | None = None,
        generators: Sequence[torch.Generator] = (),
    ) -> None:
        self.fn = fn
        self.static_inputs = tuple(static_inputs)
        device = self.static_inputs[0].device
        if stream is None and pool is not None:
            stream = pool.stream
        side = torch.cuda.Stream(device=device) if stream is None else stream
        # Warm up on a side stream, as capture requires: lazy inits (cuBLAS handles, Triton compiles,
        # autotuning) must happen outside the graph.
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(*self.static_inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        for g in generators:
            # A sampling step draws from its own CUDA generator: registered, each replay advances that
            # generator's Philox offset as an eager call would, instead of replaying the same draws.
            self.graph.register_generator_state(g)
        with torch.cuda.graph(self.graph, pool=None if pool is None else pool.handle, stream=side):
            self.static_outputs = fn(*self.static_inputs)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != len(self.static_inputs):
            raise TypeError(f"graphed step takes {len(self.static_inputs)} tensors, got {len(inputs)}")
        for dst, src in zip(self.static_inputs, inputs, strict=True):
            if src is not dst:
                dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.static_outputs


def capture(
    fn: Callable[..., Any],
    static_inputs: Tensors,
    *,
    enabled: bool = True,
    warmup: int = 2,
    pool: GraphPool | None = None,
    stream: torch.cuda.Stream | None = None,
    generators: Sequence[torch.Generator] = (),
) -> Callable[..., Any]:
    """`fn` captured in a CUDA graph over `static_inputs` (CUDA and enabled), else `fn` itself.

    generators: CUDA generators `fn` samples from (torch >= 2.4 registers them with the graph).
    """
    if not enabled or not static_inputs or static_inputs[0].device.type != "cuda":
        return fn
    return Graphed(fn, static_inputs, warmup=warmup, pool=pool, stream=stream, generators=generators)


class Chain:
    """Steps run one after another as one step (`capture_chain`): each part reads the outputs of the part
    before it, and the chain's inputs, in place."""

    def __init__(self, parts: Sequence[Callable[..., Any]], static_inputs: Tensors) -> None:
        self.parts = list(parts)
        self.static_inputs = tuple(static_inputs)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        for dst, src in zip(self.static_inputs, inputs, strict=True):
            if src is not dst:
                dst.copy_(src, non_blocking=True)
        out: Any = ()
        for part in self.parts:
            out = part(*(out if isinstance(out, tuple) else (out,)), *self.static_inputs)
        return out


def capture_chain(
    fns: Sequence[Callable[..., Any]], static_inputs: Tensors, pool: GraphPool | None
) -> Callable[..., Any]:
    """One step as several graphs launched back to back: `fns[0](*inputs)`, then each
    `fns[k](*outputs of fns[k - 1], *inputs)`, the last one's outputs the step's. Each part is captured
    (`capture_or_eager`) over the static outputs of the part before it, so replays pass them on in place,
    with no copy between parts. One function: `capture_or_eager` of it. The parts share `pool` and replay in
    the order they were captured, as the graphs of one runner do (see the module's docstring)."""
    if len(fns) == 1:
        return capture_or_eager(fns[0], static_inputs, pool)
    static_inputs = tuple(static_inputs)
    parts, out = [], ()
    for fn in fns:
        inputs = (*out, *static_inputs)
        part = capture_or_eager(fn, inputs, pool)
        parts.append(part)
        out = part(*inputs)  # a graph's static outputs, which the next part is captured over
        out = out if isinstance(out, tuple) else (out,)
    return Chain(parts, static_inputs)


def graphs_on(settings: Any, device: torch.device) -> bool:
    """Capture CUDA graphs? Only where there is CUDA (the CPU runs the same functions eagerly)."""
    return settings.cuda_graphs and device.type == "cuda"


def capture_or_eager(
    fn: Callable[..., Any], static_inputs: Tensors, pool: GraphPool | None
) -> Callable[..., Any]:
    """A CUDA graph of `fn`, or `fn` itself if this step cannot be captured (it then runs eagerly)."""
    return capture_or_none(fn, static_inputs, pool, "running eagerly") or fn


def capture_or_none(
    fn: Callable[..., Any], static_inputs: Tensors, pool: GraphPool | None, instead: str
) -> Callable[..., Any] | None:
    """A CUDA graph of `fn`, or None if it cannot be captured (a warning says so and what is done `instead`)."""
    try:
        return capture(fn, static_inputs, pool=pool)
    except Exception as e:  # e.g. a MoE backend that syncs with the host: eager is still correct
        warnings.warn(f"CUDA graph capture failed, {instead}: {type(e).__name__}: {e}", stacklevel=3)
        torch.cuda.synchronize()
        return None
