"""Graph capture without a GPU: every step a runner captures must make no host sync and build no
tensor from host data, or CUDA-graph capture fails on the H200 (and the runner silently falls back to
eager). The meta device checks exactly that on the CPU: it has no data, so `.item()`, `.tolist()`,
`bool(t)`, `nonzero` and friends raise there, and a tensor made on the host meets a meta tensor as a
device mismatch. Also: the Code2Wav first chunk (1 frame) replays its graph."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from test_engine import FakeGraph

import omni_rt
import omni_rt.pipeline.graphs as graphs
from omni_rt.config import EngineSettings
from omni_rt.model.config import preset
from omni_rt.model.omni import OmniModel
from omni_rt.pipeline.graphs import capture
from omni_rt.pipeline.request import Request
from omni_rt.pipeline.runners import Code2WavRunner, TalkerRunner, ThinkerRunner

META = torch.device("meta")
SETTINGS = EngineSettings(max_sessions=2, max_context=64, max_talker_context=64)


@pytest.fixture(scope="module")
def meta_model():
    # "gather" experts: static shapes (the GPU's grouped_mm is too; the CPU's exact "loop" syncs)
    return OmniModel.build(preset("tiny"), device=META, dtype="float32", weights=None, moe_impl="gather")


def ids(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.long, device=META)


def test_meta_device_catches_a_host_sync(meta_model):
    """The check below can fail: the CPU's exact expert loop (`unique().tolist()`) is not capturable."""
    moe = meta_model.thinker.model.layers[0].mlp
    x = torch.zeros(3, moe.gate.in_features, device=META)
    moe.impl = "loop"
    try:
        with pytest.raises((RuntimeError, NotImplementedError)):
            moe(x[None])
    finally:
        moe.impl = "gather"


def test_thinker_steps_are_capturable(meta_model):
    r = ThinkerRunner(meta_model, SETTINGS)
    slots, cfg = ids(2), meta_model.cfg.thinker
    for t in (1, 16):  # padded prefill buckets
        embeds = torch.zeros(2, t, cfg.hidden_size, device=META)
        index = torch.full((2,), t - 1, dtype=torch.long, device=META)
        first, logits, hidden = r._prefill_fn(64)(
            embeds, torch.arange(t, device=META).expand(2, t), slots, index
        )
        assert first.shape == (2,) and logits.shape == (2, cfg.vocab_size)  # sampled inside the step
        assert hidden.shape == embeds.shape
    assert r._decode_fn(64)(ids(2, 1), ids(2, 1), slots).shape == (2,)


def test_talker_steps_are_capturable(meta_model):
    r = TalkerRunner(meta_model, SETTINGS)
    width = meta_model.cfg.talker.hidden_size
    hidden = r._prefix_fn(64)(
        torch.zeros(1, 16, width, device=META), torch.arange(16, device=META)[None], ids(1)
    )
    assert hidden.shape == (1, 16, width)
    assert r._last_fn(64)(ids(1), ids(1, 1), ids(1)).shape == (1,)  # code 0; hidden: by slot, inside
    groups = meta_model.cfg.num_code_groups
    assert r._step_fn(64)(ids(2, groups), ids(2), ids(2, 1), ids(2)).shape == (2,)
    assert r._last_hidden.shape == (SETTINGS.max_sessions + 1, width)
    # a whole frame, sampled or greedy per slot, with its draws keyed on the device
    assert r._frame_fn(ids(2), ids(2), ids(2)).shape == (2, groups)


@pytest.mark.parametrize("frames", [1, 2, 16])
def test_code2wav_chunk_steps_are_capturable(meta_model, frames):
    c2w = Code2WavRunner(meta_model, SETTINGS)
    q = meta_model.cfg.code2wav.num_quantizers
    state = meta_model.code2wav.new_state(1)
    wav = meta_model.code2wav.step(ids(1, q, frames), state)
    assert wav.shape == (1, 1, c2w.samples_per_frame * frames)


def test_capture_is_the_function_itself_off_the_gpu():
    def fn(x):
        return x + 1

    assert capture(fn, (torch.zeros(2),)) is fn
    assert capture(fn, (torch.zeros(2),), enabled=False) is fn


def test_code2wav_first_chunk_replays_its_graph(monkeypatch):
    """The first chunk of a response is 1 frame and goes through the 1-frame graph, with the PCM of
    the eager decode; so does every chunk size the schedule uses."""
    model = omni_rt.Engine.load("tiny").model
    settings = EngineSettings(max_sessions=2)
    assert settings.chunk_sizes()[0] == 1
    captured: dict[int, FakeGraph] = {}
    replays: list[int] = []

    def fake_capture(fn, static, **kw):
        g = FakeGraph(fn, static)
        captured[static[0].shape[-1]] = g
        call = g.__call__

        def replay(*inputs):
            replays.append(inputs[0].shape[-1])
            return call(*inputs)

        return replay

    eager = Code2WavRunner(model, settings)
    monkeypatch.setattr(graphs, "graphs_on", lambda s, device: s.cuda_graphs)
    monkeypatch.setattr(graphs, "capture", fake_capture)
    graphed = Code2WavRunner(model, settings)
    assert sorted(captured) == settings.chunk_sizes()
    req = object.__new__(Request)
    req.slot = 1
    rng = np.random.default_rng(0)
    q, vocab = model.cfg.code2wav.num_quantizers, model.cfg.code2wav.codebook_size
    frames = rng.integers(0, vocab, size=(7, q)).tolist()
    out = {}
    for name, runner in (("eager", eager), ("graphed", graphed)):
        runner.open(req)
        out[name] = [runner.push(req, frames[a:b]) for a, b in ((0, 1), (1, 3), (3, 7))]
        out[name].append(runner.flush(req))
    assert replays == [1, 2, 4]  # the first chunk (1 frame) replayed its graph
    for a, b in zip(out["eager"], out["graphed"], strict=True):
        np.testing.assert_array_equal(a, b)


class FakeStream:
    """A pooled CUDA stream as PyTorch hands them out: `POOL` handles, round-robin."""

    POOL, drawn = 4, 0

    def __init__(self, device=None, priority=0):
        self.device_index, self.cuda_stream = 0, 1000 + FakeStream.drawn % FakeStream.POOL
        FakeStream.drawn += 1

    def wait_stream(self, other):
        pass


def test_stage_streams_never_share_a_pooled_stream(monkeypatch):
    # PyTorch's pool wraps after 32 streams; two stages on one stream would share the cuBLAS workspace
    # their graphs were captured with (graphs.py), and their threads replay at once
    from omni_rt.pipeline import stage_device

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(stage_device, "_stage_streams", type(stage_device._stage_streams)())
    cuda = torch.device("cuda")
    live = [stage_device.stage_stream(cuda, 0) for _ in range(3)]
    for _ in range(5):  # other code draws from the pool meanwhile, so the next draw would collide
        FakeStream()
        s = stage_device.stage_stream(cuda, 0)
        assert s.cuda_stream not in {x.cuda_stream for x in live}
        del s  # a stage that is gone frees its stream for the next
    live.append(stage_device.stage_stream(cuda, 0))
    assert len({s.cuda_stream for s in live}) == 4
    with pytest.raises(RuntimeError, match="no CUDA stream free"):
        stage_device.stage_stream(cuda, 0)  # every pooled stream is a live stage's


def test_a_runners_graphs_are_captured_on_its_pools_stream(monkeypatch):
    # where the graph is captured keys its cuBLAS workspace: the runner's own stream, not a fresh one
    seen = []

    class Graph:
        def replay(self):
            pass

    class Capture:
        def __init__(self, graph, pool=None, stream=None):
            seen.append(stream)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1), raising=False)
    own = FakeStream()
    pool = graphs.GraphPool(own)
    x = torch.zeros(2)
    for _ in range(3):
        graphs.Graphed(lambda t: t + 1, (x,), pool=pool)
    assert seen == [own, own, own]
