"""What the MoE kernel scripts (gpu_kernels, gpu_moe_prefill) share: shapes, inputs, bandwidth, graphed timing.

R calls, cycling over several layers' weights (so they come from HBM, not L2) and several routings, are
captured in one CUDA graph and replayed between CUDA events; the eager time of the same calls comes along.
"""

from __future__ import annotations

import math
import time

import torch

R = 16  # calls per captured graph


def time_graph(fn, layers, inputs, replays: int = 30) -> tuple[float, float]:
    """fn(x, ids, weights, gate_up, down) over `layers` [(gate_up, down)] and `inputs` [(x, ids, weights)]:
    (µs per call graphed, µs per call eager)."""
    outs = []

    def run_all():
        outs.clear()
        for r in range(R):
            gu, dn = layers[r % len(layers)]
            x, ids, w = inputs[r % len(inputs)]
            outs.append(fn(x, ids, w, gu, dn))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside capture: Triton compiles, cuBLAS picks kernels
            run_all()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        run_all()
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - t0) / (3 * R) * 1e6
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all()
    graph.replay()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(replays):
        graph.replay()
    en.record()
    torch.cuda.synchronize()
    us = st.elapsed_time(en) * 1e3 / (replays * R)
    del graph
    return us, eager_us


SHAPES = {  # the real MoE shapes: experts, hidden, expert intermediate, top-k
    "thinker": dict(E=128, H=2048, I=768, k=8),
    "talker": dict(E=128, H=1024, I=384, k=6),
}
LAYERS = 4  # weight copies cycled through, 4 x 1.2 GB at Thinker shapes >> L2


def measure_bandwidth(dev) -> float:
    """Device-to-device copy of 2 GiB, bytes read + written over time: the streaming ceiling (B/s)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    torch.cuda.synchronize()
    bw = 10 * 2 * a.numel() * 2 / (s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return bw


def make_layers(shape, dtype, dev, layers: int = LAYERS, seed: int = 0):
    """`layers` random (gate_up [E, 2I, H], down [E, H, I]) pairs, scaled to keep activations O(1)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    E, H, inter = shape["E"], shape["H"], shape["I"]
    out = []
    for _ in range(layers):
        gu = torch.randn(E, 2 * inter, H, generator=g, device=dev, dtype=dtype) / math.sqrt(H)
        dn = torch.randn(E, H, inter, generator=g, device=dev, dtype=dtype) / math.sqrt(inter)
        out.append((gu, dn))
    return out


def make_inputs(shape, n, dtype, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(n, shape["H"], generator=g, device=dev, dtype=dtype)
    logits = torch.randn(n, shape["E"], generator=g, device=dev, dtype=torch.float32)
    w, ids = torch.softmax(logits, -1).topk(shape["k"], dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    return x, ids, w


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))
