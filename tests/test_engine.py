"""The engine end to end on the tiny preset (CPU): streaming equals the offline truth, first audio
before the text ends, concurrent sessions, multi-turn cache reuse, metrics, clean start/stop."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import omni_rt
from omni_rt.model.offline import generate_offline
from omni_rt.pipeline.runners import Code2WavRunner, TalkerRunner, ThinkerRunner, build_runners

GREEDY = omni_rt.Sampling.greedy()


class RecordingCode2Wav(Code2WavRunner):
    """Keeps every request's frames and float PCM, to compare with the offline decode."""

    def __init__(self, model, settings):
        super().__init__(model, settings)
        self.frames: dict[str, list[list[int]]] = {}
        self.pcm: dict[str, list[np.ndarray]] = {}

    def push(self, req, frames):
        pcm = super().push(req, frames)
        self._record(req, frames, pcm)
        return pcm

    def push_many(self, reqs, frames):  # with code2wav_batch, several responses' chunks in one call
        if len(reqs) == 1:
            return [self.push(reqs[0], frames[0])]
        pcms = super().push_many(reqs, frames)
        for req, f, pcm in zip(reqs, frames, pcms, strict=True):
            self._record(req, f, pcm)
        return pcms

    def _record(self, req, frames, pcm):
        self.frames.setdefault(req.id, []).extend(frames)
        self.pcm.setdefault(req.id, []).append(pcm)


@pytest.fixture(scope="module")
def tiny():
    return omni_rt.Engine.load("tiny")


@pytest.fixture
def engine(tiny):
    """A fresh engine on the tiny model whose Code2Wav runner records codes and PCM."""
    recorder: dict = {}

    def stages(settings):
        c2w = RecordingCode2Wav(tiny.model, settings)
        recorder["c2w"] = c2w
        return ThinkerRunner(tiny.model, settings), TalkerRunner(tiny.model, settings), c2w

    e = omni_rt.Engine(
        tiny.cfg, tiny.tokenizer, stages, omni_rt.EngineSettings(max_sessions=3), model=tiny.model
    )
    e.recorder = recorder
    return e


def prompt(tok, text: str) -> list[int]:
    return tok.chat_prompt([("user", text)])


async def collect(session, **kw) -> list:
    return [ev async for ev in session.respond(**kw)]


def of(events, kind: str) -> list:
    return [e for e in events if e.type == kind]


def reply(engine, events) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(text token ids, codes [groups, N], int16 PCM) of a finished response."""
    rid = events[-1].response_id
    tokens = [t for e in of(events, "response.output_text.delta") for t in e.token_ids]
    frames = engine.recorder["c2w"].frames.get(rid, [])
    codes = np.array(frames, dtype=np.int64).T.reshape(engine.cfg.num_code_groups, -1)
    pcm = np.concatenate(
        [e.pcm for e in of(events, "response.output_audio.delta")] or [np.zeros(0, np.int16)]
    )
    return tokens, codes, pcm


async def test_greedy_stream_equals_offline(engine, tiny):
    ids = prompt(tiny.tokenizer, "Tell me something.")
    async with engine:
        async with engine.session() as s:
            events = await collect(
                s, input_ids=ids, sampling=GREEDY, max_output_tokens=10, max_audio_frames=14
            )
    done = events[-1]
    assert done.type == "response.done" and done.status == "completed"
    tokens, codes, pcm = reply(engine, events)
    text, ref_codes, ref_wav = generate_offline(
        tiny.model, ids, "ethan", GREEDY.thinker, GREEDY.talker, max_new_tokens=10, max_frames=14
    )
    # the session leaves out the end-of-turn token from the text deltas
    assert tokens == [t for t in text if t != tiny.cfg.ids.im_end]
    np.testing.assert_array_equal(codes, ref_codes.numpy())
    # streamed PCM == one offline decode of the same codes (float, then as int16 on the wire)
    streamed = np.concatenate(engine.recorder["c2w"].pcm[done.response_id])
    offline = tiny.model.code2wav(torch.as_tensor(codes)[None]).reshape(-1).float().numpy()
    assert len(streamed) == len(offline) == len(ref_wav)
    np.testing.assert_allclose(streamed, offline, atol=1e-5)
    np.testing.assert_allclose(offline, ref_wav.numpy(), atol=1e-5)
    assert np.abs(pcm.astype(np.int32) - np.round(offline * 32767).astype(np.int32)).max() <= 1
    assert len(of(events, "response.output_audio.done")) == 1
    assert done.usage.output_tokens == len(text) and done.usage.audio_frames == codes.shape[1]


@pytest.mark.parametrize("threads", [1, None])
async def test_each_cpu_stage_thread_runs_torch_with_its_own_thread_count(tiny, threads):
    """`cpu_stage_threads`: the stage threads' torch thread count, set in each of them; None leaves them
    what a new thread gets from torch."""
    import threading

    fresh: list[int] = []
    probe = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    probe.start()
    probe.join()

    seen: dict[str, int] = {}

    class Counting(ThinkerRunner):
        def decode(self, reqs):
            seen[threading.current_thread().name] = torch.get_num_threads()
            return super().decode(reqs)

    def stages(settings):
        return (
            Counting(tiny.model, settings),
            TalkerRunner(tiny.model, settings),
            Code2WavRunner(tiny.model, settings),
        )

    main = torch.get_num_threads()
    settings = omni_rt.EngineSettings(cpu_stage_threads=threads)
    async with omni_rt.Engine(tiny.cfg, tiny.tokenizer, stages, settings, model=tiny.model) as e:
        async with e.session() as s:
            await collect(s, text="Hi", sampling=GREEDY, max_output_tokens=3, max_audio_frames=3)
    assert seen == {"omni-rt-thinker": threads or fresh[0]}
    assert torch.get_num_threads() == main  # a thread that has run torch keeps its count


async def test_first_audio_arrives_before_the_last_text_delta(engine, tiny):
    async with engine:
        async with engine.session() as s:
            events = await collect(
                s, text="Go on, talk.", sampling=GREEDY, max_output_tokens=40, max_audio_frames=44
            )
    types = [e.type for e in events]
    first_audio = types.index("response.output_audio.delta")
    last_text = len(types) - 1 - types[::-1].index("response.output_text.delta")
    assert first_audio < last_text
    m = events[-1].metrics
    assert m.ttfa_ms is not None and m.ttft_ms is not None
    assert m.thinker_first_token_ms <= m.talker_first_code_ms <= m.first_pcm_ms <= m.ttfa_ms
    assert m.audio_seconds > 0 and m.rtf > 0 and m.text_tokens_per_s > 0
    # the Thinker's yield to this response's first audio (12 ms by default) reports how it ended
    assert engine.settings.yield_to_talker_ms > 0
    assert m.thinker_yield in ("first_audio", "not_needed", "cap")


async def test_two_sessions_at_once_get_what_they_get_alone(engine, tiny):
    texts = ["First speaker here.", "A different question?"]
    kw = dict(sampling=GREEDY, max_output_tokens=8, max_audio_frames=10)
    async with engine:
        alone = []
        for t in texts:
            async with engine.session() as s:
                alone.append(reply(engine, await collect(s, text=t, **kw)))
        async with engine.session() as a, engine.session(voice="chelsie") as b:
            both = await asyncio.gather(
                collect(a, text=texts[0], **kw), collect(b, text=texts[1], **kw, voice="ethan")
            )
        batched = any(len(st.request_ids) == 2 for st in engine.pipeline.steps if st.kind == "decode")
    for (tok0, codes0, pcm0), events in zip(alone, both, strict=True):
        tok1, codes1, pcm1 = reply(engine, events)
        assert tok1 == tok0
        np.testing.assert_array_equal(codes1, codes0)
        np.testing.assert_array_equal(pcm1, pcm0)
    assert batched  # they really shared Thinker decode steps


async def test_second_turn_prefills_only_new_tokens_and_matches_a_fresh_session(engine, tiny):
    kw = dict(sampling=GREEDY, max_output_tokens=6, max_audio_frames=8)
    async with engine:
        async with engine.session() as s:
            first = await collect(s, text="Hi.", **kw)
            second = await collect(s, text="And then?", **kw)
            conversation = list(s.conversation)
        t1 = [t for e in of(first, "response.output_text.delta") for t in e.token_ids]
        done2 = second[-1]
        assert done2.status == "completed"
        # turn 2 reused everything but the last token of reply 1 from the cache
        ids = tiny.cfg.ids
        turn2 = tiny.tokenizer.chat_prompt([("user", "And then?")])
        whole = prompt(tiny.tokenizer, "Hi.") + t1 + ([] if t1[-1:] == [ids.im_end] else [ids.im_end])
        whole += [ids.newline] + turn2
        # (usage counts the end-of-turn token the text deltas leave out; the last token was never fed)
        assert (
            done2.usage.cached_tokens
            == len(prompt(tiny.tokenizer, "Hi.")) + first[-1].usage.output_tokens - 1
        )
        assert done2.usage.cached_tokens + done2.usage.input_tokens == len(whole)
        async with engine.session() as fresh:
            again = await collect(fresh, input_ids=whole, **kw)
    tok2, codes2, _ = reply(engine, second)
    tok3, codes3, _ = reply(engine, again)
    assert tok2 == tok3
    np.testing.assert_array_equal(codes2, codes3)
    assert conversation[: len(whole)] == whole


async def test_engine_start_stop_leaves_no_threads(engine):
    for _ in range(2):
        async with engine:
            assert engine.running
            async with engine.session() as s:
                events = await collect(
                    s, text="Quick.", sampling=GREEDY, max_output_tokens=2, max_audio_frames=2
                )
                assert events[-1].status == "completed"
        assert not engine.running
        assert not [t for t in threading.enumerate() if t.name.startswith("omni-rt-")]
    with pytest.raises(omni_rt.EngineClosedError):
        engine.session()


async def test_seeded_sampling_is_the_same_alone_in_a_batch_and_offline(tiny):
    """A seed fixes a response's tokens, codes and PCM: alone, among 3 other sessions sampling at once,
    and in `generate_offline`; another seed differs. Deterministic mode runs each row on its own (so CPU
    matmul blocking cannot differ between batch sizes); the draws themselves are keyed by seed, stage and
    position (test_sampling checks a batched call against single rows)."""
    settings = omni_rt.EngineSettings(max_sessions=4, deterministic=True)
    ids = prompt(tiny.tokenizer, "Sample away.")
    others = [prompt(tiny.tokenizer, t) for t in ("One more.", "And a longer second one, please.", "Third.")]
    kw = dict(max_output_tokens=8, max_audio_frames=10)

    async def run(batch: list[tuple[list[int], int]]):
        stages = lambda st: build_runners(tiny.model, st)  # noqa: E731
        engine = omni_rt.Engine(tiny.cfg, tiny.tokenizer, stages, settings, model=tiny.model)
        async with engine:
            sessions = [engine.session() for _ in batch]
            try:
                return await asyncio.gather(
                    *(collect(s, input_ids=p, sampling=omni_rt.Sampling(seed=k), **kw) for s, (p, k) in
                      zip(sessions, batch, strict=True))
                )  # fmt: skip
            finally:
                for s in sessions:
                    await s.close()

    def out(events):
        tokens = [t for e in of(events, "response.output_text.delta") for t in e.token_ids]
        pcm = np.concatenate([e.pcm for e in of(events, "response.output_audio.delta")])
        return tokens, pcm

    (alone,) = await run([(ids, 7)])
    batched = await run([(others[0], 1), (ids, 7), (others[1], 2), (others[2], 7)])
    (other_seed,) = await run([(ids, 8)])
    a, b = out(alone), out(batched[1])
    assert a[0] == b[0] and np.array_equal(a[1], b[1])
    c = out(other_seed)
    assert a[0] != c[0] or not np.array_equal(a[1], c[1])
    s = omni_rt.Sampling(seed=7)
    text, _, wav = generate_offline(
        tiny.model, ids, "ethan", s.thinker, s.talker, max_new_tokens=8, max_frames=10, seed=7
    )
    assert a[0] == [t for t in text if t != tiny.cfg.ids.im_end]
    assert len(a[1]) == len(wav)
    np.testing.assert_allclose(a[1] / 32767.0, np.clip(wav.numpy(), -1, 1), rtol=0, atol=2.0 / 32767)


async def test_seeded_sampling_stream_equals_offline(engine, tiny):
    # draws are keyed by (seed, stage, position), so the interleaving of the stages does not matter
    sampling = omni_rt.Sampling(seed=7)
    ids = prompt(tiny.tokenizer, "Sample away.")
    async with engine:
        async with engine.session() as s:
            events = await collect(
                s, input_ids=ids, sampling=sampling, max_output_tokens=8, max_audio_frames=10
            )
    tokens, codes, _ = reply(engine, events)
    text, ref_codes, _ = generate_offline(
        tiny.model, ids, "ethan", sampling.thinker, sampling.talker, max_new_tokens=8, max_frames=10, seed=7
    )
    assert tokens == [t for t in text if t != tiny.cfg.ids.im_end]
    np.testing.assert_array_equal(codes, ref_codes.numpy())


async def test_every_switch_off_gives_the_same_output(tiny):
    """The optimisations change when things happen, never what comes out."""
    ids = prompt(tiny.tokenizer, "Same words, please.")
    outs = []
    for settings in (omni_rt.EngineSettings(), omni_rt.EngineSettings.all_off(deterministic=True)):
        engine = omni_rt.Engine.load("tiny", settings=settings)
        async with engine, engine.session() as s:
            events = await collect(s, input_ids=ids, sampling=GREEDY, max_output_tokens=7, max_audio_frames=9)
        assert events[-1].status == "completed"
        sizes = [e.num_frames for e in of(events, "response.output_audio.delta")]
        outs.append((reply_text_and_pcm(events), sizes))
    (on, on_sizes), (off, off_sizes) = outs
    assert on[0] == off[0]
    # same codes; PCM decoded in other chunk sizes agrees to float rounding (1 LSB)
    assert len(on[1]) == len(off[1])
    assert np.abs(on[1].astype(np.int32) - off[1].astype(np.int32)).max() <= 1
    assert on_sizes[0] == 1 and off_sizes[0] == 4


def reply_text_and_pcm(events) -> tuple[list[int], np.ndarray]:
    tokens = [t for e in of(events, "response.output_text.delta") for t in e.token_ids]
    return tokens, np.concatenate([e.pcm for e in of(events, "response.output_audio.delta")])


def test_padded_batch_prefill_matches_one_at_a_time(tiny):
    from omni_rt.pipeline.request import Request

    settings = omni_rt.EngineSettings(max_sessions=3, max_context=512)
    prompts = [
        prompt(tiny.tokenizer, "Short."),
        prompt(tiny.tokenizer, "A much longer question than that one?"),
    ]

    def requests() -> list[Request]:
        return [
            Request(id=f"r{i}", slot=i, prompt_ids=p, thinker_start=0, talker_start=0, speaker_id=2302,
                    sampling=GREEDY, max_output_tokens=4, max_audio_frames=4, sink=print, t0=0.0)
            for i, p in enumerate(prompts)
        ]  # fmt: skip

    alone = [ThinkerRunner(tiny.model, settings).prefill([r])[0] for r in requests()]
    runner = ThinkerRunner(tiny.model, settings)
    reqs = requests()
    assert runner.prefill(reqs) == alone
    # the padding wrote nothing a later step reads: decoding on from the batch gives the same tokens
    for r, t in zip(reqs, alone, strict=True):
        r.tokens.append(t)
    batched_next = runner.decode(reqs)
    one = ThinkerRunner(tiny.model, settings)
    singles = []
    for r in requests():
        r.tokens.append(one.prefill([r])[0])
        singles.append(one.decode([r])[0])
    assert batched_next == singles


async def test_checkpoint_directory_streams_what_offline_makes(reference, checkpoint):
    """Engine.load(DIR) on a Hugging Face checkpoint saved from the reference (a well-conditioned small
    model; offline == reference is tests/test_parity.py), a multi-turn prompt with a system turn."""
    from hf_fixtures import SMALL_CONFIGS

    cfg = SMALL_CONFIGS["tiny"]
    i = cfg.ids
    conversation = [
        *[i.im_start, i.system, i.newline, 2610, 525, 264, 10950, 17847, i.im_end, i.newline],
        *[i.im_start, i.user, i.newline, 9707, 0, i.im_end, i.newline],
        *[i.im_start, i.assistant, i.newline, 13048, 11, 1246, 646, i.im_end, i.newline],
        *[i.im_start, i.user, i.newline, 3838, 374, 279, 9104, 30, i.im_end, i.newline],
        *[i.im_start, i.assistant, i.newline],
    ]
    with pytest.warns(UserWarning, match="no tokenizer"):
        engine = omni_rt.Engine.load(str(checkpoint("tiny")))
    async with engine, engine.session() as s:
        events = await collect(
            s, input_ids=conversation, sampling=GREEDY, max_output_tokens=8, max_audio_frames=40
        )
    done = events[-1]
    assert done.status == "completed"
    text, codes, wav = generate_offline(
        engine.model, conversation, "ethan", GREEDY.thinker, GREEDY.talker, 8, 40
    )
    assert done.usage.output_tokens == len(text) and done.usage.audio_frames == codes.shape[1] >= 3
    tokens = [t for e in of(events, "response.output_text.delta") for t in e.token_ids]
    assert tokens == [t for t in text if t != i.im_end]
    pcm = np.concatenate([e.pcm for e in of(events, "response.output_audio.delta")])
    assert len(pcm) == len(wav)
    assert np.abs(pcm.astype(np.int32) - np.round(wav.numpy() * 32767).astype(np.int32)).max() <= 1


class FakeGraph:
    """CUDA-graph semantics on the CPU: static inputs copied in, outputs in buffers that every call
    overwrites. Catches a runner that keeps a graph's output past the next replay, or feeds a graph
    something other than its static inputs."""

    def __init__(self, fn, static_inputs, **kwargs):
        self.fn, self.static = fn, tuple(static_inputs)
        self.fn(*self.static)  # warm-up, as capture does (it writes the scratch slot)
        self.out = None

    def __call__(self, *inputs):
        for dst, src in zip(self.static, inputs, strict=True):
            dst.copy_(src)
        out = self.fn(*self.static)
        outs = out if isinstance(out, tuple) else (out,)
        if self.out is None:
            self.out = tuple(o.clone() for o in outs)
        else:
            for buf, o in zip(self.out, outs, strict=True):
                buf.copy_(o)
        return self.out if isinstance(out, tuple) else self.out[0]


@pytest.mark.parametrize("deterministic", [False, True], ids=["batched", "row-by-row"])
async def test_graph_replays_give_the_eager_output(tiny, monkeypatch, deterministic):
    import omni_rt.pipeline.graphs as graphs

    texts = ["One graph.", "Two graphs!"]
    kw = dict(sampling=GREEDY, max_output_tokens=6, max_audio_frames=9)

    async def serve() -> list:
        engine = omni_rt.Engine.load(
            "tiny", max_sessions=2, max_context=512, max_talker_context=512, deterministic=deterministic
        )
        async with engine:
            async with engine.session() as a, engine.session() as b:
                both = await asyncio.gather(collect(a, text=texts[0], **kw), collect(b, text=texts[1], **kw))
            async with engine.session() as c:  # and again alone, multi-turn, on a used slot
                both.append(await collect(c, text=texts[0], **kw))
                both.append(await collect(c, text=texts[1], **kw))
        return [reply_text_and_pcm(events) for events in both]

    eager = await serve()
    captured = []
    monkeypatch.setattr(graphs, "graphs_on", lambda settings, device: True)
    monkeypatch.setattr(
        graphs, "capture", lambda fn, static, **k: captured.append(fn) or FakeGraph(fn, static)
    )
    graphed = await serve()
    assert len(captured) >= 10  # Thinker (batch x kv bucket), Talker step and frame, Code2Wav chunks
    for (tok0, pcm0), (tok1, pcm1) in zip(eager, graphed, strict=True):
        assert tok1 == tok0
        np.testing.assert_array_equal(pcm1, pcm0)


async def test_speech_turn_streams_what_offline_makes(checkpoint):
    """A spoken turn on a saved reference checkpoint (its audio tower loaded from the same directory;
    well-conditioned weights, so the Talker's frames depend on the audio it reads from the Thinker)."""
    rng = np.random.default_rng(3)
    t = np.arange(int(16000 * 1.3)) / 16000
    clip = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 3 * t)) + 0.02 * rng.standard_normal(
        len(t)
    )
    clip = clip.astype(np.float32)
    kw = dict(sampling=GREEDY, max_output_tokens=6, max_audio_frames=8)
    with pytest.warns(UserWarning, match="no tokenizer"):
        engine = omni_rt.Engine.load(str(checkpoint("tiny")))
    ids = engine.cfg.ids
    async with engine, engine.session() as s:
        events = await collect(s, audio=clip, **kw)
        prompt = s.conversation[: len(s.conversation) - events[-1].usage.output_tokens]
        follow_up = await collect(s, text="And in words?", **kw)  # a text turn after a spoken one
    assert events[-1].status == "completed" and follow_up[-1].status == "completed"
    assert follow_up[-1].usage.cached_tokens == len(prompt) + events[-1].usage.output_tokens - 1

    # the truth: the offline loop, given the same prompt and clip
    text, codes, wav = generate_offline(
        engine.model, prompt, "ethan", GREEDY.thinker, GREEDY.talker, 6, 8, audio=[clip]
    )
    tokens = [t for e in of(events, "response.output_text.delta") for t in e.token_ids]
    assert tokens == [t for t in text if t != ids.im_end]
    assert events[-1].usage.audio_frames == codes.shape[1]
    pcm = np.concatenate([e.pcm for e in of(events, "response.output_audio.delta")])
    assert len(pcm) == len(wav)
    assert np.abs(pcm.astype(np.int32) - np.round(wav.numpy() * 32767).astype(np.int32)).max() <= 1


def test_kernel_settings_are_a_config_error_where_triton_cannot_run():
    # on a CPU without Triton's interpreter, asking for the GPU kernels fails at load, clearly
    code = (
        "import omni_rt\n"
        "from omni_rt.errors import ConfigError\n"
        "for kw in ({'moe_backend': 'triton'}, {'fused_kernels': True}, {'moe_prefill_kernel': True}):\n"
        "    try:\n"
        "        omni_rt.Engine.load('tiny', **kw)\n"
        "    except ConfigError as e:\n"
        "        assert 'Triton' in str(e), e\n"
        "    else:\n"
        "        raise SystemExit(f'no ConfigError for {kw}')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"max_sesions": 8}, "max_sesions"),  # a misspelt setting is an error, not silently dropped
        ({"max_sessions": 0}, "max_sessions"),
        ({"settings": omni_rt.EngineSettings(), "max_context": 1}, "max_context"),
        ({"device": "nonsense"}, "device"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_load_rejects_bad_settings_with_a_config_error(kw, match):
    with pytest.raises(omni_rt.ConfigError, match=match):
        omni_rt.Engine.load("tiny", **kw)


def test_load_applies_overrides_over_given_settings():
    e = omni_rt.Engine.load("tiny", settings=omni_rt.EngineSettings(max_context=64), max_sessions=2)
    assert (e.settings.max_context, e.settings.max_sessions) == (64, 2)


def test_an_engine_around_a_built_model_gets_the_device_defaults_load_gives(tiny):
    # the bench's later rows wrap the first row's model: on a GPU they ran without Code2Wav batching,
    # which only Engine.load turned on
    wrapped = omni_rt.Engine(
        tiny.cfg, tiny.tokenizer, lambda s: None, omni_rt.EngineSettings(), model=tiny.model
    )
    assert wrapped.settings == tiny.settings
    assert (wrapped.settings.code2wav_batch, wrapped.settings.chunk_plan_rate) == (False, 1.1)  # the CPU's


async def test_concurrent_start_and_stop_leave_one_pipeline_then_none(engine):
    # two start() calls racing (a lifespan hook and a lazy start) built two pipelines: one was orphaned,
    # its threads and caches never stopped
    await asyncio.gather(engine.start(), engine.start())
    assert sum(t.name == "omni-rt-thinker" for t in threading.enumerate()) == 1
    await asyncio.gather(engine.stop(), engine.start())  # a stop and a start: in the order called
    await engine.stop()
    assert not [t for t in threading.enumerate() if t.name.startswith("omni-rt-")]
