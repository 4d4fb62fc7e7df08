"""Timing an expert function at real shapes, shared by the MoE kernel scripts (gpu_kernels, gpu_moe_prefill).

R calls, cycling over several layers' weights (so they come from HBM, not L2) and several routings, are
captured in one CUDA graph and replayed between CUDA events; the eager time of the same calls comes along.
"""

from __future__ import annotations

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
