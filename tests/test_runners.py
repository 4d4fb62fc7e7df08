"""The stage runners on the tiny preset (CPU), CUDA graphs emulated (`FakeGraph`: static inputs copied
in, output buffers overwritten by every replay): right-padded prefill graphs give what the unpadded
eager prefill gives, alone and beside a slot mid-generation; padding never leaks into later steps or
other slots; the Talker's prefix waits for the Thinker's launch; every new switch off is today's path."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from test_engine import FakeGraph

import omni_rt
import omni_rt.pipeline.graphs as graphs
from omni_rt.config import EngineSettings
from omni_rt.pipeline.request import Request
from omni_rt.pipeline.runners import (
    LaunchGate,
    TalkerRunner,
    ThinkerRunner,
    build_runners,
)
from omni_rt.pipeline.shapes import (
    batch_bucket,
    batch_buckets,
    pad_rows,
    prefill_bucket,
    prefill_lengths,
    prefill_shapes,
)
from omni_rt.pipeline.stage_device import StepInputs, host_ids, to_host
from omni_rt.tokenizer import Tokenizer

GREEDY = omni_rt.Sampling.greedy()
# small buckets, so that the tiny prompts (~20 ids) pad, and short caches: few graphs to capture
SETTINGS = dict(max_sessions=2, max_context=96, max_talker_context=96, prefill_buckets=(8, 32, 48))


class CountingGraph(FakeGraph):
    replays = 0  # per instance once called

    def __call__(self, *inputs):
        self.replays += 1
        return super().__call__(*inputs)


@pytest.fixture(scope="module")
def model():
    return omni_rt.Engine.load("tiny").model


def emulate_graphs(monkeypatch) -> list[CountingGraph]:
    """Runners built from now on capture (emulated) graphs as on a GPU when `cuda_graphs`; listed in
    order (the `graphed` fixture, here and in test_code2wav_runner.py)."""
    captured: list[CountingGraph] = []
    monkeypatch.setattr(graphs, "graphs_on", lambda settings, device: settings.cuda_graphs)
    monkeypatch.setattr(
        graphs, "capture", lambda fn, static, **k: captured.append(CountingGraph(fn, static)) or captured[-1]
    )
    return captured


@pytest.fixture
def graphed(monkeypatch):
    return emulate_graphs(monkeypatch)


def request(model, text: str, slot: int, history: list[int] | None = None) -> Request:
    """A greedy request for `text` in `slot`. `history`: the conversation so far, in the slot's caches
    but for its last token (a reply's last sampled token is never fed: the next turn feeds it)."""
    history = history or []
    prompt = history + Tokenizer.tiny(model.cfg.ids).chat_prompt([("user", text)])
    return Request(
        id=f"r{slot}-{len(prompt)}",
        slot=slot,
        prompt_ids=prompt,
        thinker_start=max(len(history) - 1, 0),
        talker_start=0,
        speaker_id=model.cfg.speaker_id("ethan"),
        sampling=GREEDY,
        max_output_tokens=8,
        max_audio_frames=8,
        sink=lambda m: None,
        t0=0.0,
    )


def thinker_trace(runner: ThinkerRunner, reqs: list[Request], steps: int) -> tuple[list, list]:
    """Prefill `reqs` together, then `steps` decode steps: (prefill logits [B, V], tokens per step)."""
    with torch.inference_mode():  # as `stage_call` runs a CPU runner
        logits = runner._prefill_first(reqs)[1].clone()
    for r, t in zip(reqs, runner.prefill(reqs), strict=True):  # again: same rows, same cache writes
        r.tokens = [t]
    tokens = [[r.tokens[0] for r in reqs]]
    for _ in range(steps):
        out = runner.decode(reqs)
        for r, t in zip(reqs, out, strict=True):
            r.tokens.append(t)
        tokens.append(out)
    return logits, tokens


def test_buckets():
    assert prefill_bucket(1, (16, 32), 4096) == 16
    assert prefill_bucket(17, (16, 32), 4096) == 32
    assert prefill_bucket(33, (16, 32), 4096) is None  # above the largest: eager
    assert prefill_bucket(20, (16, 32), 24) == 24  # capped at the cache length
    assert prefill_lengths((16, 32, 64), 40) == [16, 32, 40]
    # a bucket is attended over its own kv bucket and every larger one (prefills later in the cache)
    assert prefill_shapes((16, 512), 1024) == [(16, 256), (16, 512), (16, 1024), (512, 512), (512, 1024)]
    # batches: every size to 8, then multiples of 8, and the session ceiling (32 sessions: 11 sizes, not 32)
    assert batch_buckets(32) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32]
    assert batch_buckets(20) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 20] and batch_buckets(1) == [1]
    assert [batch_bucket(n, 20) for n in (1, 3, 9, 17, 20, 30)] == [1, 3, 16, 20, 20, 30]
    x = torch.arange(6).view(3, 2)
    assert pad_rows(x, 3, -1) is x
    assert pad_rows(x, 4, -1).tolist() == [[0, 1], [2, 3], [4, 5], [-1, -1]]
    with pytest.raises(ValueError):
        EngineSettings(prefill_buckets=(32, 16))
    with pytest.raises(ValueError):
        EngineSettings(prefill_buckets=())


def test_thinker_padded_graph_prefill_equals_eager(model, graphed):
    s = EngineSettings(**SETTINGS)
    g = ThinkerRunner(model, s)
    assert {k[1] for k in g._prefill_graphs} == {8, 32, 48}
    eager_graphs = len(graphed)
    e = ThinkerRunner(model, s.model_copy(update={"cuda_graphs": False}))
    assert len(graphed) == eager_graphs and not e._prefill_graphs
    req_g, req_e = request(model, "Hello there.", 0), request(model, "Hello there.", 0)
    n = len(req_g.new_prompt_ids)
    assert 8 < n < 32  # padded to 32
    logits_g, tokens_g = thinker_trace(g, [req_g], steps=4)
    logits_e, tokens_e = thinker_trace(e, [req_e], steps=4)
    assert g._prefill_graphs[(1, 32, 96)].replays >= 1  # the graph ran
    torch.testing.assert_close(logits_g, logits_e, rtol=1e-4, atol=1e-5)
    assert tokens_g == tokens_e  # decode after padded prefill: the padding rows were overwritten first


class LogitsSpy:
    """A stage's sampler that keeps a copy of the logits of every call."""

    def __init__(self, sampler) -> None:
        self.sampler, self.logits = sampler, []

    def __getattr__(self, name: str):
        return getattr(self.sampler, name)

    def __call__(self, logits: torch.Tensor, *args):
        self.logits.append(logits.clone())
        return self.sampler(logits, *args)


@pytest.mark.parametrize("segments", [2, 64])
def test_a_decode_step_graphed_in_segments_gives_the_one_graph_tokens(model, graphed, segments):
    """`thinker_graph_segments`: the decode step (and the prefill) as consecutive graphs of its layers (64:
    one a layer), each replayed once a step; the logits the last one samples from are those of the step in
    one graph, and its ids those of the eager step too."""
    layers = model.cfg.thinker.num_hidden_layers
    assert layers >= 2
    texts = ["Hello there.", "A much longer question, about the weather today?"]
    traces, logits = [], []
    for n in (segments, 1, None):
        s = EngineSettings(**SETTINGS, cuda_graphs=n is not None, thinker_graph_segments=n or 1)
        first = len(graphed)
        runner = ThinkerRunner(model, s)
        runner.sampler = drawn = LogitsSpy(runner.sampler)
        reqs = [request(model, t, i) for i, t in enumerate(texts)]
        prefill_logits, tokens = thinker_trace(runner, reqs, steps=5)
        traces.append(tokens)
        logits.append(torch.cat([prefill_logits, *drawn.logits[-5:]]))  # the prefill's, the 5 steps'
        parts = [c for c in graphed[first:] if c.fn.__name__ == "part"]
        if n == segments:
            chain = runner._graphs[(2, 96)]
            assert len(chain.parts) == min(segments, layers) and all(p in parts for p in chain.parts)
            assert {p.replays for p in chain.parts} == {1 + 5}  # the chain's capture call, then 5 steps
        else:
            assert not parts
    assert traces[0] == traces[1] == traces[2]
    assert torch.equal(logits[0], logits[1])  # the same operations, in the same order
    torch.testing.assert_close(logits[0], logits[2], rtol=1e-4, atol=1e-5)  # eager: unpadded prefills


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_a_prefill_in_parts_returns_what_the_whole_prefill_does(model, keep):
    """`thinker_graph_segments` cuts the prefill too, and at the layer whose output a speech turn's Talker
    reads (`accept_hidden_layer`: 0 the embeddings, 2 after the final norm here): its parts, run one after
    another, return the first ids, logits and hidden states of the prefill in one function, bit for bit."""
    runner = ThinkerRunner(model, EngineSettings(**SETTINGS, cuda_graphs=False, thinker_graph_segments=2))
    runner.accept_hidden_layer = keep
    req = request(model, "Hello there, how are you?", 0)
    runner.sampler.assign(0, req.sampling.thinker, req.seed)
    ids = torch.tensor([req.prompt_ids])
    inputs = (
        model.thinker.embed(ids),
        torch.arange(ids.shape[1])[None],
        torch.tensor([0]),
        torch.tensor([ids.shape[1] - 1]),
    )
    parts = runner._in_parts(96, prefill=True)
    assert len(parts) == 2
    with torch.inference_mode():
        out = ()
        for part in parts:
            out = part(*out, *inputs)
        whole = runner._prefill_fn(96)(*inputs)
    for a, b in zip(out, whole, strict=True):
        assert torch.equal(a, b)


def test_thinker_padded_prefill_beside_a_slot_mid_generation(model, graphed):
    """Slot 1 is decoding when slot 0 prefills through a padded graph: slot 1's tokens are those it
    makes alone (no cross-slot writes) and slot 0's are the eager ones, second turn included."""
    s = EngineSettings(**SETTINGS)
    g = ThinkerRunner(model, s)
    e = ThinkerRunner(model, s.model_copy(update={"cuda_graphs": False}))

    def run(runner: ThinkerRunner, with_slot0: bool) -> list:
        other = request(model, "A long story, please.", 1)
        _, first = thinker_trace(runner, [other], steps=2)
        out = [first]
        if with_slot0:
            mine = request(model, "Hi!", 0)
            out.append(thinker_trace(runner, [mine], steps=1)[1])
            both = runner.decode([mine, other])  # batched decode over both slots
            out.append(both)
            # the next turn of slot 0 starts after everything in its cache: a padded prefill at p > 0
            history = mine.prompt_ids + mine.tokens + [both[0]]
            turn2 = request(model, "And then?", 0, history=history)
            out.append(thinker_trace(runner, [turn2], steps=2))
        else:
            out.append(runner.decode([other]))
        out.append(runner.decode([other]))
        return out, other.tokens

    graphed_out, other_g = run(g, with_slot0=True)
    eager_out, other_e = run(e, with_slot0=True)
    _, other_alone = run(e, with_slot0=False)
    assert graphed_out[:3] == eager_out[:3]
    torch.testing.assert_close(graphed_out[3][0], eager_out[3][0], rtol=1e-4, atol=1e-5)
    assert graphed_out[3][1] == eager_out[3][1]
    assert other_g == other_e == other_alone


def test_batched_padded_prefill_equals_one_at_a_time(model, graphed):
    s = EngineSettings(**SETTINGS, prefill_graph_batches=2)
    g = ThinkerRunner(model, s)
    assert (2, 32, 96) in g._prefill_graphs
    e = ThinkerRunner(model, s.model_copy(update={"cuda_graphs": False}))
    texts = ["Hi!", "What a fine day it is today."]
    logits_g, tokens_g = thinker_trace(g, [request(model, t, i) for i, t in enumerate(texts)], steps=2)
    alone = [thinker_trace(e, [request(model, t, i)], steps=2) for i, t in enumerate(texts)]
    torch.testing.assert_close(logits_g, torch.cat([a[0] for a in alone]), rtol=1e-4, atol=1e-5)
    assert [list(col) for col in zip(*tokens_g, strict=True)] == [[t[0] for t in a[1]] for a in alone]


def test_prompts_arriving_together_without_a_batched_graph_replay_the_single_graph_each(model, graphed):
    # prefill_graph_batches=1: a batch of two has no graph; run eagerly it cost 125-178 ms on an H200
    # under load against 22 ms for each graphed prompt, and held every other conversation
    s = EngineSettings(**SETTINGS, prefill_graph_batches=1)
    g = ThinkerRunner(model, s)
    assert not any(k[0] == 2 for k in g._prefill_graphs)
    texts = ["Hi!", "What a fine day it is today."]
    reqs = [request(model, t, i) for i, t in enumerate(texts)]
    calls = []
    real = g._prefill_fn
    g._prefill_fn = lambda kv_len: calls.append(kv_len) or real(kv_len)  # the eager path
    logits, _ = thinker_trace(g, reqs, steps=1)
    assert not calls and sum(c.replays for c in g._prefill_graphs.values()) == 4  # 2 prompts, traced twice
    e = ThinkerRunner(model, s.model_copy(update={"cuda_graphs": False}))  # eager: one batched call
    e_calls = []
    real_e = e._prefill_fn
    e._prefill_fn = lambda kv_len: e_calls.append(kv_len) or real_e(kv_len)
    logits_e, _ = thinker_trace(e, [request(model, t, i) for i, t in enumerate(texts)], 1)
    assert len(e_calls) == 2  # one batched call per trace
    torch.testing.assert_close(logits, logits_e, rtol=1e-4, atol=1e-5)


def test_more_prompts_arriving_together_than_a_batched_graph_holds_go_in_graphed_batches(model, graphed):
    s = EngineSettings(**(SETTINGS | {"max_sessions": 3}), prefill_graph_batches=2)
    g = ThinkerRunner(model, s)
    reqs = [request(model, t, i) for i, t in enumerate(["Hi!", "Hello there.", "What a fine day."])]
    assert g._prefill_groups([0, 1, 2], reqs) == [[0, 1], [2]]  # 2 + 1, both graphed
    assert g._prefill_groups([0, 1], reqs[:2]) == [[0, 1]]
    e = ThinkerRunner(model, s.model_copy(update={"cuda_graphs": False}))
    assert e._prefill_groups([0, 1, 2], reqs) == [[0, 1, 2]]  # eager: one batch


def test_speech_prefill_through_the_padded_graph_equals_eager(model, graphed):
    """A spoken turn enters as embeddings through the same graphs: the same logits, and the same
    hidden states for the Talker at every real position."""
    import numpy as np

    from omni_rt.audio.features import audio_token_count, log_mel
    from omni_rt.model.speech_input import speech_prompt

    s = EngineSettings(**SETTINGS)
    g = ThinkerRunner(model, s)
    e = ThinkerRunner(model, s.model_copy(update={"cuda_graphs": False}))
    t = np.arange(8000) / 16000
    features = log_mel((0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000)  # [128, F]
    count = int(audio_token_count(features.shape[1], int(model.cfg.audio_config.get("n_window", 50))))
    out = []
    for runner in (g, e):
        req = request(model, "", 0)
        req.prompt_ids = speech_prompt(model.cfg.ids, [count], text_ids=[65, 66])
        req.audio_features = [features]
        with torch.no_grad():
            logits = runner._prefill_first([req])[1]
        out.append((logits, req.thinker_hidden))
    assert any(c.replays for c in g._prefill_graphs.values())
    assert len(req.prompt_ids) < 32 and out[0][1].shape == out[1][1].shape == (len(req.prompt_ids), 64)
    for a, b in zip(out[0], out[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_prefill_past_the_cache_end_runs_unpadded(model, graphed):
    """A second turn whose padding would pass the cache's last row runs eagerly, unpadded: padded
    positions clamped to the last row could land on a real token's row in the same call."""
    s = EngineSettings(**SETTINGS)
    g = ThinkerRunner(model, s)
    e = ThinkerRunner(model, s.model_copy(update={"cuda_graphs": False}))
    history = request(model, "Hello there, how are you?", 0).prompt_ids * 2  # ~50 positions
    reqs = {}
    for name, runner in (("g", g), ("e", e)):
        head = request(model, "Hello there, how are you?", 0)
        head.prompt_ids = history  # the first turn: the whole history as its prompt
        thinker_trace(runner, [head], steps=0)
        reqs[name] = request(model, "Ok.", 0, history=history)
    req = reqs["g"]
    assert prefill_bucket(len(req.new_prompt_ids), s.prefill_buckets, 96) + req.thinker_start > 96
    assert g._prefill_shape([req])[2] is None  # no graph: unpadded
    lg, tg = thinker_trace(g, [reqs["g"]], steps=2)
    le, te = thinker_trace(e, [reqs["e"]], steps=2)
    torch.testing.assert_close(lg, le, rtol=1e-4, atol=1e-5)
    assert tg == te


def talker_trace(runner: TalkerRunner, req: Request, first_token: int, steps: int) -> list:
    """Prefix prefill, the last position (code 0), frames and `steps` Talker steps: codes and hiddens."""
    runner.prefill_prefix([req])
    code0 = runner.prefill_last([req], [first_token])[0]
    out = [code0, runner._last_hidden[req.slot].clone()]
    frame = runner.predict([req], [code0])[0]
    for _ in range(steps):
        code0 = runner.step([req], [frame], [req.prompt_ids[-1]])[0]
        frame = runner.predict([req], [code0])[0]
        out += [frame, runner._last_hidden[req.slot].clone()]
    return out


def assert_same_trace(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
        else:
            assert x == y


def test_talker_padded_prefix_graph_equals_eager(model, graphed):
    s = EngineSettings(**SETTINGS)
    g = TalkerRunner(model, s)
    assert {k[1] for k in g._prefix_graphs} == {8, 32, 48}
    e = TalkerRunner(model, s.model_copy(update={"cuda_graphs": False}))
    assert not e._prefix_graphs
    # slot 1 mid-generation on both runners, then slot 0's prefix through a padded graph
    other_g, other_e = request(model, "Another voice.", 1), request(model, "Another voice.", 1)
    before = [talker_trace(g, other_g, 7, steps=1), talker_trace(e, other_e, 7, steps=1)]
    assert_same_trace(*before)
    mine = [talker_trace(r, request(model, "Hello there.", 0), 9, steps=3) for r in (g, e)]
    assert_same_trace(*mine)
    assert any(c.replays for c in graphed if c.fn.__name__ == "prefix")
    # slot 1 goes on as it would alone: its next step, and its frame, from the hidden state its own
    # step left in the slots' pool (slot 0's steps wrote only slot 0's row)
    frame = [1] * model.cfg.num_code_groups
    after = [r.step([o], [frame], [5]) for r, o in ((g, other_g), (e, other_e))]
    frames = [r.predict([o], a) for r, o, a in ((g, other_g, after[0]), (e, other_e, after[1]))]
    alone = TalkerRunner(model, s.model_copy(update={"cuda_graphs": False}))
    other = request(model, "Another voice.", 1)
    talker_trace(alone, other, 7, steps=1)
    assert after[0] == after[1] == alone.step([other], [frame], [5])
    assert frames[0] == frames[1] == alone.predict([other], after[0])


def start_together(runner: TalkerRunner, reqs: list[Request], firsts: list[int]) -> list:
    """The prefixes and first positions of `reqs` in one call each, then one frame and one step: codes
    and hiddens per request."""
    runner.prefill_prefix(reqs)
    code0 = runner.prefill_last(reqs, firsts)
    hidden = [runner._last_hidden[r.slot].clone() for r in reqs]
    frames = runner.predict(reqs, code0)
    after = runner.step(reqs, frames, [r.prompt_ids[-1] for r in reqs])
    return [[c, h, f, a] for c, h, f, a in zip(code0, hidden, frames, after, strict=True)]


def test_responses_that_start_together_get_what_they_get_one_at_a_time(model, graphed):
    # three arrivals, prefill graphs for batches of two: calls of 2 + 1, each through its batch's graph
    s = EngineSettings(**(SETTINGS | {"max_sessions": 3}), prefill_graph_batches=2)
    texts, firsts = ["Hi!", "Hello there, how are you?", "What a fine day."], [9, 4, 7]
    g = TalkerRunner(model, s)
    together = start_together(g, [request(model, t, i) for i, t in enumerate(texts)], firsts)
    starts = {(c.fn.__name__, c.static[0].shape[0]) for c in graphed if c.replays}
    assert starts >= {("last", 1), ("last", 2), ("prefix", 1), ("prefix", 2)}
    assert not {("last", 3), ("prefix", 3)} & starts
    e = TalkerRunner(model, s.model_copy(update={"cuda_graphs": False}))  # eager: one call of three
    eager = start_together(e, [request(model, t, i) for i, t in enumerate(texts)], firsts)
    for i, (t, f) in enumerate(zip(texts, firsts, strict=True)):
        alone = TalkerRunner(model, s.model_copy(update={"cuda_graphs": False}))
        (one,) = start_together(alone, [request(model, t, i)], [f])
        assert_same_trace(together[i], one)
        assert_same_trace(eager[i], one)


def test_only_the_batches_with_a_graph_share_a_call(model, graphed):
    s = EngineSettings(**(SETTINGS | {"max_sessions": 3}), prefill_graph_batches=1)
    reqs = [request(model, t, i) for i, t in enumerate(["Hi!", "Hello there.", "A fine day."])]
    runners = {
        "graphs, batch 1 only": (TalkerRunner(model, s), [[r] for r in reqs]),
        "graphs up to 8 rows (the GPU default)": (
            TalkerRunner(model, EngineSettings(**SETTINGS | {"max_sessions": 3})),
            [reqs],
        ),
        "eager": (TalkerRunner(model, s.model_copy(update={"cuda_graphs": False})), [reqs]),
        "deterministic": (
            TalkerRunner(model, s.model_copy(update={"cuda_graphs": False, "deterministic": True})),
            [[r] for r in reqs],
        ),
        "no batch_prefill": (
            TalkerRunner(model, s.model_copy(update={"cuda_graphs": False, "batch_prefill": False})),
            [[r] for r in reqs],
        ),
    }
    for name, (runner, calls) in runners.items():
        runner._prompt_len = {r.slot: 20 for r in reqs}
        assert runner._batches(reqs, runner._last_plan) == calls, name


def test_frame0_made_from_code0_on_the_device(model, graphed):
    """`prefill_last` runs the frame graph on its device code 0; `predict` hands that frame out
    (no second replay) and it is the frame the eager path predicts. A frame left behind (code 0 was
    EOS) is never handed to a later request of the slot."""
    s = EngineSettings(**SETTINGS)
    g, e = TalkerRunner(model, s), TalkerRunner(model, s.model_copy(update={"cuda_graphs": False}))
    frame_graph = g._frame_graphs[1]
    codes = []
    for runner in (g, e):
        req = request(model, "Hello there.", 0)
        runner.prefill_prefix([req])
        code0 = runner.prefill_last([req], [9])[0]
        before = frame_graph.replays
        codes.append(runner.predict([req], [code0])[0])
        if runner is g:
            assert frame_graph.replays == before == 1  # made once, in prefill_last
    assert codes[0] == codes[1]
    req = request(model, "Hello there.", 0)
    g.prefill_prefix([req])
    g.prefill_last([req], [9])  # say code 0 was EOS: the scheduler never asks for this frame
    req2 = request(model, "Something else entirely.", 0)
    g.prefill_prefix([req2])
    g.settings = g.settings.model_copy(update={"frame0_in_prefill": False})  # the next makes none early
    code0 = g.prefill_last([req2], [4])[0]
    assert req2.slot not in g._frame_ahead  # the stale frame is gone, whatever the codes 0 were
    e.prefill_prefix([req2])
    assert e.prefill_last([req2], [4])[0] == code0
    assert g.predict([req2], [code0]) == e.predict([req2], [code0])


@pytest.mark.parametrize("sampled", [False, True])
def test_a_steps_frame_is_made_behind_it_on_the_device(model, graphed, sampled):
    """`frames_in_step`: `step` replays the frame graph on its device code 0 and `predict` hands that
    frame out (no replay of its own); the codes are those of a runner that predicts after the step
    (sampled: the frame's draws keyed by the step's position, as `predict` keys them)."""
    s = EngineSettings(**SETTINGS)
    g = TalkerRunner(model, s)
    e = TalkerRunner(model, s.model_copy(update={"frames_in_step": False}))
    out = []
    for runner in (g, e):
        frame_graph = runner._frame_graphs[1]
        req = request(model, "Hello there.", 0)
        if sampled:
            req.sampling = omni_rt.Sampling(seed=5)
            req.seed = req.sampling.response_seed()
        runner.prefill_prefix([req])
        frames = [runner.predict([req], [runner.prefill_last([req], [9])[0]])[0]]
        for text in (11, 12, 13):
            code0 = runner.step([req], [frames[-1]], [text])[0]
            before = frame_graph.replays
            frames.append(runner.predict([req], [code0])[0])
            assert frame_graph.replays == before + int(runner is e)  # g made it in `step`
        out.append(frames)
    assert out[0] == out[1]


def test_step_inputs_fill_their_rows_and_pad_the_rest_in_the_same_tensors():
    """What a graph is captured over stays the same tensors (a replay copies no input); each fill writes
    its rows and pads the rest, whatever an earlier fill left."""
    inputs = StepInputs([(3, 2), (3,), (3, 1)], [0, 9, 5], torch.device("cpu"))
    first = inputs.tensors
    assert [t.tolist() for t in first] == [[[0, 0]] * 3, [9, 9, 9], [[5]] * 3]  # what capture reads
    got = inputs.fill([[[1, 2], [3, 4], [5, 6]], [7, 8, 6], [1, 2, 3]])
    assert got is first and all(t.is_contiguous() for t in got)
    inputs.fill([[[1, 2]], [7], [4]])
    assert [t.tolist() for t in first] == [[[1, 2], [0, 0], [0, 0]], [7, 9, 9], [[4], [5], [5]]]


def test_read_backs_give_the_values_in_memory_of_their_own():
    """`host_ids` and `to_host`, pinned or not (pinned is a GPU's; on the CPU both copy)."""
    out = torch.arange(6).view(3, 2)
    for pinned in (False, True):
        assert host_ids([out[:1], out[1:]], pinned) == [[0, 1], [2, 3], [4, 5]]
        host = to_host(out, pinned)
        out[0, 0] = 7  # a graph's output buffer, overwritten by its next replay
        assert host[0, 0].item() == 0 and host.device.type == "cpu"
        out[0, 0] = 0


def test_launch_gate():
    gate = LaunchGate(timeout_s=0.01)
    a, b = object.__new__(Request), object.__new__(Request)
    assert gate.wait([a]) is False  # never opened: gives up after the timeout
    gate.open([a])
    assert gate.wait([a]) is True and gate.wait([b]) is False and gate.wait([a, b]) is False


def test_talker_prefix_waits_for_the_thinker_launch(model):
    s = EngineSettings(**SETTINGS)
    gate = LaunchGate(timeout_s=10.0)
    thinker, talker = ThinkerRunner(model, s, gate), TalkerRunner(model, s, gate)
    req = request(model, "Hello.", 0)
    events: list[str] = []
    t = threading.Thread(target=lambda: (talker.prefill_prefix([req]), events.append("talker")))
    t.start()
    time.sleep(0.2)
    assert events == [] and req.slot not in talker._prompt_len  # still waiting
    thinker.prefill([req])
    events.append("thinker")
    t.join(10)
    assert "talker" in events and req.slot in talker._prompt_len


def test_switches_off_give_todays_runners(model, graphed):
    off = EngineSettings.all_off(**SETTINGS, cuda_graphs=True)  # graphs, but not the new switches
    thinker, talker, _ = build_runners(model, off)
    assert thinker.gate is None and talker.gate is None
    assert not thinker._prefill_graphs and not talker._prefix_graphs
    assert thinker._graphs and talker._last_graphs  # the per-token graphs are unchanged
    on_thinker, on_talker, _ = build_runners(model, EngineSettings(**SETTINGS))
    assert on_thinker.gate is on_talker.gate is not None
    no_overlap = EngineSettings(**SETTINGS, talker_overlap_prefill=False)
    assert build_runners(model, no_overlap)[0].gate is None  # the prefix comes after the prefill anyway


async def test_engine_with_prefill_graphs_streams_what_eager_does(model, graphed):
    """End to end: a greedy response, all graphs emulated, equals the eager engine's, tokens and PCM."""
    import numpy as np

    async def serve(**kw) -> tuple[list, np.ndarray]:
        engine = omni_rt.Engine.load("tiny", **SETTINGS, **kw)
        async with engine, engine.session() as sess:
            events = [
                ev
                async for ev in sess.respond(
                    "Say it.", sampling=GREEDY, max_output_tokens=5, max_audio_frames=6
                )
            ]
        tokens = [t for e in events if e.type == "response.output_text.delta" for t in e.token_ids]
        pcm = np.concatenate([e.pcm for e in events if e.type == "response.output_audio.delta"])
        return tokens, pcm

    graphed_run = await serve()
    assert any(c.replays for c in graphed if c.fn.__name__ == "prefill")
    assert any(c.replays for c in graphed if c.fn.__name__ == "prefix")
    eager_run = await serve(cuda_graphs=False)
    assert graphed_run[0] == eager_run[0]
    np.testing.assert_array_equal(graphed_run[1], eager_run[1])


def test_a_cut_spoken_turn_reaches_the_next_talker_prompt_through_carried_hidden(model):
    """A spoken turn whose reply was cut before the Talker prefilled it: the next (text) turn's Talker
    prompt must read that turn's audio positions from the Thinker's hidden states carried over, exactly
    as a prompt built from the whole conversation's hidden states, not from zeros."""
    import numpy as np

    from omni_rt.audio.features import audio_token_count, log_mel
    from omni_rt.model.speech_input import speech_prompt
    from omni_rt.model.talker import talker_prompt_prefix

    s = EngineSettings(**SETTINGS).model_copy(update={"cuda_graphs": False})
    thinker, talker = ThinkerRunner(model, s), TalkerRunner(model, s)
    t = np.arange(8000) / 16000
    features = log_mel((0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000)
    count = int(audio_token_count(features.shape[1], int(model.cfg.audio_config.get("n_window", 50))))
    turn1 = request(model, "", 0)
    turn1.prompt_ids = speech_prompt(model.cfg.ids, [count], text_ids=[65, 66])
    turn1.audio_features = [features]
    with torch.no_grad():
        thinker._prefill_first([turn1])
    spoken = turn1.thinker_hidden  # [P1, H], the Talker never saw it
    reply = [70, 71]
    history = turn1.prompt_ids + reply + [model.cfg.ids.im_end, model.cfg.ids.newline]
    turn2 = request(model, "And now?", 0, history=history)
    turn2.carried_hidden = spoken
    whole = torch.zeros(len(turn2.prompt_ids), spoken.shape[1])
    whole[: spoken.shape[0]] = spoken
    embed = model.thinker.embed
    speaker = turn2.speaker_id
    with torch.no_grad():
        want = talker_prompt_prefix(model.talker, embed, turn2.prompt_ids, speaker, whole)
        zeros = talker_prompt_prefix(model.talker, embed, turn2.prompt_ids, speaker, torch.zeros_like(whole))
        got = talker.prompt_prefix(turn2)
    assert not torch.allclose(want, zeros)  # the audio positions do read the hidden states
    torch.testing.assert_close(got, want)
    # a spoken second turn keeps the carried rows beside its own
    turn3 = request(model, "", 0, history=history)
    turn3.prompt_ids = speech_prompt(model.cfg.ids, [count], text_ids=[67], history=history)
    turn3.audio_features, turn3.carried_hidden = [features], spoken
    with torch.no_grad():
        thinker._prefill_first([turn3])
    torch.testing.assert_close(turn3.thinker_hidden[: spoken.shape[0]], spoken)


def test_a_prompt_prefilled_in_pieces_continues_as_the_whole_prompt(model, graphed):
    """A long prompt written a piece at a time (each through the padded prefill graphs at its own
    offset), then its last piece with the first draw: the same logits and tokens as one prefill."""
    s = EngineSettings(**SETTINGS)
    text = "Tell me a long story about the sea, the ships and the sailors, please."
    for runner in (
        ThinkerRunner(model, s),
        ThinkerRunner(model, s.model_copy(update={"cuda_graphs": False})),
    ):
        whole, pieces = request(model, text, 0), request(model, text, 1)
        assert len(pieces.new_prompt_ids) > 24
        while len(pieces.pending_prompt_ids) > 8:
            runner.prefill_piece(pieces, 8)
        assert pieces.prefilled >= 16 and pieces.prefill_start == pieces.prefilled
        logits_w, tokens_w = thinker_trace(runner, [whole], steps=4)
        logits_p, tokens_p = thinker_trace(runner, [pieces], steps=4)
        torch.testing.assert_close(logits_p, logits_w, rtol=1e-4, atol=1e-5)
        assert tokens_p == tokens_w
