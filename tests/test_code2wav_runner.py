"""The Code2Wav runner on the tiny preset (CPU), CUDA graphs emulated as in test_runners.py: batched and
ragged calls each decode exactly their own streams, a chunk size without a graph goes as graphed pieces,
every call that touches a stream's state runs on the runner's stream, resets only where needed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_runners import emulate_graphs, request

import omni_rt
import omni_rt.pipeline.runners as runners
from omni_rt.config import EngineSettings
from omni_rt.pipeline.shapes import code2wav_buckets

# A batched conv sums in another order than a row alone: PCM within float rounding (1.01e-6 apart on
# the 2026-12-05 CI machine's CPU). A row that read another's frames or state is off by ~0.1.
ROUNDING = 1e-5


@pytest.fixture(scope="module")
def model():
    return omni_rt.Engine.load("tiny").model


@pytest.fixture
def graphed(monkeypatch):
    return emulate_graphs(monkeypatch)


def test_every_code2wav_call_that_touches_its_state_runs_on_its_stream(model, monkeypatch):
    # open/close reset a slot's device state: on the legacy default stream (which PyTorch's streams do
    # not wait for) a reset could land after the next response's first chunk read the old state
    runner = runners.Code2WavRunner(model, EngineSettings(max_sessions=1))
    on_stream = []

    class Stream:  # stands in for torch.cuda.stream(runner.stream)
        def __init__(self, s):
            assert s == "code2wav stream"

        def __enter__(self):
            on_stream.append(True)

        def __exit__(self, *exc):
            on_stream.pop()

    monkeypatch.setattr(torch.cuda, "stream", Stream)  # the stage_call wrapper's
    runner.stream = "code2wav stream"
    state = runner._streams[0]
    resets = []
    monkeypatch.setattr(state, "reset", lambda *a: resets.append(bool(on_stream)))
    req = request(model, "Hi", slot=0)
    runner.open(req)
    runner.push(req, [[1] * model.cfg.num_code_groups])
    runner.flush(req)
    runner.close(req)
    assert len(resets) == 2 and all(resets)  # flush (the stream starts afresh), close; open found it fresh


def _code2wav_streams(model, graphs: bool, seed: int, slots: tuple[int, ...]):
    """A batching Code2Wav runner, a random-codes maker, a request per slot, and for each the oracle: the
    model's own stream, with `pcm(stream, frames)` its PCM of the next frames."""
    from omni_rt.model.code2wav_stream import Code2WavStream

    s = EngineSettings(max_sessions=4, code2wav_batch=True, cuda_graphs=graphs)
    runner = runners.Code2WavRunner(model, s)
    gen = torch.Generator().manual_seed(seed)
    q, vocab = model.cfg.code2wav.num_quantizers, model.cfg.code2wav.codebook_size
    codes = lambda n: torch.randint(0, vocab, (n, q), generator=gen).tolist()  # noqa: E731
    reqs = [request(model, "Hi", slot=k) for k in slots]
    alone = [Code2WavStream(model.code2wav) for _ in reqs]
    pcm = lambda stream, frames: stream.push(torch.tensor(frames).T).numpy()  # noqa: E731
    return runner, codes, reqs, alone, pcm


@pytest.mark.parametrize("graphs", [True, False])
def test_code2wav_chunks_of_several_responses_in_one_call_are_each_its_own_stream(model, graphed, graphs):
    # three responses at different points of their streams (first chunk, a few frames in, further on),
    # their next 2-frame chunks decoded in one call: each is what its own stream alone decodes (within
    # float rounding: a batched conv sums in another order; deterministic mode decodes one at a time)

    batched, codes, reqs, alone, pcm = _code2wav_streams(model, graphs, seed=3, slots=(0, 2, 3))
    if graphs:
        assert code2wav_buckets(4) == [1, 2, 4] and (4, 2) in batched._graphs
    for r, stream, history in zip(reqs, alone, [[], codes(1), codes(5)], strict=True):
        batched.open(r)
        if history:
            batched.push(r, history)
            pcm(stream, history)
    nxt = [codes(2) for _ in reqs]
    together = batched.push_many(reqs, nxt)
    assert [len(x) for x in together] == [2 * 1920 - 555, 3840, 3840]
    for got, stream, frames in zip(together, alone, nxt, strict=True):
        torch.testing.assert_close(
            torch.from_numpy(got), torch.from_numpy(pcm(stream, frames)), rtol=0, atol=ROUNDING
        )
    if graphs:
        assert batched._graphs[(4, 2)].replays == 1  # 3 rows padded to 4, one replay
    # and they go on as their own streams: one more frame each, alone
    for r, stream in zip(reqs, alone, strict=True):
        more = codes(1)
        torch.testing.assert_close(
            torch.from_numpy(batched.push(r, more)),
            torch.from_numpy(pcm(stream, more)),
            rtol=0,
            atol=ROUNDING,
        )
    # the slot no response holds is as fresh as at the start: the padding row's state went to the
    # pool's scratch stream, not to a session's
    idle = batched._streams[1].state
    assert int(idle.pos) == 0 and bool((idle.key_pos == -1).all())
    assert not any(bool(b.any()) for b in (idle.k, idle.v, *idle.conv.values()))


@pytest.mark.parametrize("graphs", [True, False])
def test_code2wav_chunks_of_different_sizes_in_one_call_are_each_its_own_stream(model, graphed, graphs):
    # ragged: three responses' next chunks of 1, 4 and 3 frames (3: no graph of that size, so graphed
    # pieces 2 + 1 with each row's own frames a prefix) decode in one call, each exactly its own stream's
    # PCM, and each stream goes on as its own afterwards

    runner, codes, reqs, alone, pcm = _code2wav_streams(model, graphs, seed=8, slots=(1, 2, 3))
    for r, stream, history in zip(reqs, alone, [[], codes(2), codes(1)], strict=True):
        runner.open(r)
        if history:
            runner.push(r, history)
            pcm(stream, history)
    for sizes in ([1, 4, 3], [3, 1, 2]):
        frames = [codes(n) for n in sizes]
        got = runner.push_many(reqs, frames)
        for g, stream, f in zip(got, alone, frames, strict=True):
            torch.testing.assert_close(
                torch.from_numpy(g), torch.from_numpy(pcm(stream, f)), rtol=0, atol=ROUNDING
            )
    if graphs:
        assert [runner._graphs[(4, n)].replays for n in (1, 2, 4)] == [1, 1, 1]


@pytest.mark.parametrize("rows", [1, 3])
def test_a_chunk_size_without_a_graph_decodes_as_graphed_pieces(model, graphed, rows):
    # a reply's last chunk can have any size: with graphs (sizes 1, 2, 4, 8, 16) a 7-frame chunk is the
    # 4-, 2- and 1-frame graphs replayed in turn, not the eager step, and each stream's PCM is what its
    # own stream decodes
    runner, codes, reqs, alone, decode = _code2wav_streams(model, True, seed=5, slots=tuple(range(rows)))
    frames = [codes(7) for _ in reqs]
    for r in reqs:
        runner.open(r)
    got = runner.push_many(reqs, frames)
    bucket = 1 if rows == 1 else 4
    assert [runner._graphs[(bucket, n)].replays for n in (1, 2, 4, 8)] == [1, 1, 1, 0]
    for pcm, stream, f in zip(got, alone, frames, strict=True):
        want = decode(stream, f)
        assert len(pcm) == 7 * 1920 - 555
        torch.testing.assert_close(torch.from_numpy(pcm), torch.from_numpy(want), rtol=0, atol=ROUNDING)


def test_open_resets_a_stream_only_when_something_was_decoded_since_its_last_reset(model, monkeypatch):
    # the first chunk of a response waits for no reset of a fresh stream; a stream that decoded and was
    # not closed (a response that failed) is reset at the next open, and decodes as a fresh one again
    runner = runners.Code2WavRunner(model, EngineSettings(max_sessions=2))
    stream, resets = runner._streams[0], []
    real = stream.reset
    monkeypatch.setattr(stream, "reset", lambda *a: resets.append(1) or real(*a))
    q = model.cfg.code2wav.num_quantizers
    req, frames = request(model, "Hi", slot=0), [[1] * q, [2] * q]
    runner.open(req)
    first = runner.push(req, frames)
    assert resets == []
    runner.open(req)
    assert resets == [1]
    np.testing.assert_array_equal(runner.push(req, frames), first)


def test_a_single_stream_chunk_copies_no_frame_counts(model, graphed):
    # the first audio's path: one stream's chunk replays the one-row graph, which was captured without
    # ragged counts, so nothing is copied to the device for them (the batched work states have them)
    s = EngineSettings(max_sessions=4, code2wav_batch=True, cuda_graphs=True)
    runner = runners.Code2WavRunner(model, s)
    assert runner._work[1].valid is None and runner._work[4].valid is not None
    req = request(model, "Hi", slot=0)
    runner.open(req)
    runner.push(req, [[1] * model.cfg.code2wav.num_quantizers])
    assert runner._work[1].valid is None and runner._graphs[(1, 1)].replays == 1
