"""The benchmark: prompt layout, per-request timing, row plan, summaries, the sampling each row runs, the
Thinker's yield outcome, the reference on shared weights, the load protocol (playback lateness, the
conversation loop, a real run), and the whole `omni-rt bench` on the tiny preset on the CPU (the CI smoke
run)."""

import asyncio
import json
import types

import numpy as np
import pytest
import torch

from omni_rt import bench, bench_checks, bench_load, bench_measure, bench_reference
from omni_rt.config import EngineSettings
from omni_rt.model.config import TokenIds


def test_chat_prompt_layout_and_lengths():
    ids = TokenIds()
    p = bench.chat_prompt(20, 24, seed=0)
    assert len(p) == 57  # the anchors' 57-token prompt
    assert p[:3] == [ids.im_start, ids.system, ids.newline]
    assert p[23:29] == [ids.im_end, ids.newline, ids.im_start, ids.user, ids.newline, p[28]]
    assert p[-3:] == [ids.im_start, ids.assistant, ids.newline]
    text = p[3:23] + p[28:52]
    assert all(1000 <= t < 150000 for t in text)  # no special ids inside the turns
    assert bench.chat_prompt(20, 24, seed=0) == p and bench.chat_prompt(20, 24, seed=1) != p
    assert [len(bench.chat_prompt(20, n)) for n in (8, 24, 64)] == [41, 57, 97]


class FakeSession:
    """Scripted events with sleeps: text at 10 ms, audio at 30 ms, more text every 10 ms."""

    def __init__(self):
        self.kwargs = None

    async def respond(
        self, *, input_ids, max_output_tokens, max_audio_frames, ignore_eos=False, sampling=None
    ):
        self.kwargs = dict(ignore_eos=ignore_eos, max_output_tokens=max_output_tokens)
        ev = types.SimpleNamespace
        await asyncio.sleep(0.010)
        yield ev(type="response.output_text.delta", token_ids=[1])
        await asyncio.sleep(0.020)
        yield ev(type="response.output_audio.delta", pcm=np.zeros(2400, np.int16), sample_rate=24000)
        for _ in range(4):
            await asyncio.sleep(0.010)
            yield ev(type="response.output_text.delta", token_ids=[2, 3])
        metrics = types.SimpleNamespace(
            thinker_first_token_ms=9.0, talker_first_code_ms=20.0, first_pcm_ms=29.0
        )
        yield ev(type="response.done", status="completed", metrics=metrics)


def test_timed_request_measures_what_the_caller_receives():
    s = FakeSession()
    r = asyncio.run(bench_measure.timed_request(s, [1, 2, 3], text_tokens=9, frames=4, sampling=None))
    assert s.kwargs == {"ignore_eos": True, "max_output_tokens": 9}  # fixed lengths asked for
    assert 8 <= r.ttft_ms < r.ttfa_ms < r.total_ms
    assert r.ttfa_ms >= 28
    assert r.text_tokens == 9 and r.audio_s == pytest.approx(0.1)
    # 8 decode tokens after the first over the ~50 ms between the first and the last text delta
    assert 8 / 0.5 < r.text_tok_s <= 8 / 0.040
    assert r.rtf == pytest.approx(r.total_ms / 1e3 / 0.1)
    assert r.stages == {"thinker_first_token_ms": 9.0, "talker_first_code_ms": 20.0, "first_pcm_ms": 29.0}


def test_token_agreement_per_prompt_position():
    mk = lambda n, toks: bench.Sample(n, 1.0, 2.0, 3.0, len(toks), 0.1, None, None, token_ids=toks)  # noqa: E731
    a = [mk(41, [1, 2, 3, 4]), mk(57, [5, 6])]
    b = [mk(41, [1, 2, 9, 4]), mk(57, [5, 6, 7])]
    # prompt 41: 3 of 4 positions; prompt 57: 2 of 3 (a length difference counts against)
    assert bench_checks.token_agreement(a, b) == pytest.approx((3 / 4 + 2 / 3) / 2)
    assert bench_checks.token_agreement(a, a) == 1.0


def test_summarise_medians_min_max_and_median_request():
    mk = lambda ttfa: bench.Sample(57, 1.0, ttfa, 100.0, 64, 5.1, 100.0, 0.02)  # noqa: E731
    row = bench.summarise("x", [mk(30.0), mk(10.0), mk(20.0)])
    assert row["ttfa_ms"] == {"median": 20.0, "min": 10.0, "max": 30.0}
    assert row["median_request"]["ttfa_ms"] == 20.0
    # every request, in the order it ran: an outlier can be told from the rest
    assert [r["ttfa_ms"] for r in row["per_request"]] == [30.0, 10.0, 20.0]
    assert set(row["per_request"][0]) == {
        "prompt_len",
        "ttft_ms",
        "ttfa_ms",
        "rtf",
        "status",
        "thinker_yield",
    }
    table = bench.format_table([row, {"row": "reference", "skipped": "no transformers"}])
    assert "20.0 (10.0-30.0)" in table and "skipped: no transformers" in table


def test_row_plan_adds_one_optimisation_per_row_and_ends_all_on():
    plan = bench.row_plan("cuda", kernel_ok=True)
    assert plan[0] == ("all off", {})
    for (_, prev), (_, cur) in zip(plan, plan[1:], strict=False):
        assert set(prev.items()) < set(cur.items())  # cumulative: each row keeps all earlier switches
    assert plan[-1][0].endswith("(all on)")
    all_on = EngineSettings.all_off(**plan[-1][1])
    assert all_on.model_dump() == EngineSettings().model_dump()  # the last row is every optimisation on
    names = [n for n, _ in plan]
    kernel_rows = ["+ triton MoE decode", "+ triton MoE prefill", "+ fused kernels", "+ packed projections"]
    assert names[names.index(kernel_rows[0]) :][:4] == kernel_rows
    cpu = dict(bench.row_plan("cpu", kernel_ok=False))
    assert "+ cuda graphs" not in cpu and "+ prefill graphs" not in cpu and "+ early start" not in cpu
    kernel_fields = {"moe_backend", "moe_prefill_kernel", "fused_kernels", "packed_projections"}
    assert all(not kernel_fields & set(v) for v in cpu.values())
    cpu_last = bench.row_plan("cpu", kernel_ok=False)[-1][1]
    # on the CPU the last row is all on but for the GPU-only graphs and kernels
    gpu_only_off = EngineSettings(
        cuda_graphs=False,
        prefill_graphs=False,
        moe_backend="plain",
        moe_prefill_kernel=False,
        fused_kernels=False,
        packed_projections=False,
        pinned_readback=False,
        early_start=False,
        programmatic_launch="off",
    )
    assert EngineSettings.all_off(**cpu_last).model_dump() == gpu_only_off.model_dump()


def test_reference_model_shares_our_weights_and_matches_logits():
    pytest.importorskip("transformers")
    from omni_rt.model.config import preset
    from omni_rt.model.omni import OmniModel

    cfg = preset("tiny")
    model = OmniModel.build(cfg, weights="random", seed=3)
    ref, info = bench_reference.reference_model(model)
    # same storage, not a copy
    assert ref.thinker.lm_head.weight.data_ptr() == model.thinker.lm_head.weight.data_ptr()
    assert info["encoder_params_random"] > 0
    ids = torch.tensor([bench.chat_prompt(4, 6)])
    cache = model.thinker.allocate_cache(1, 64)
    ours, _ = model.thinker(ids, torch.arange(ids.shape[1])[None], cache, torch.zeros(1, dtype=torch.long))
    with torch.no_grad():
        theirs = ref.thinker.lm_head(ref.thinker.model(input_ids=ids, use_cache=False).last_hidden_state)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_bench_smoke_tiny_cpu(tmp_path):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    plan = bench.row_plan("cpu", kernel_ok=False)
    last = len(plan) - 1
    argv = [
        "--preset", "tiny", "--device", "cpu", "--requests", "1", "--warmup", "0",
        "--text-tokens", "3", "--frames", "3", "--prompts", "8", "--rows", f"0,{last}",
        "--concurrency", "2", "--conc-repeats", "1", "--reference", "off", "--determinism-concurrency", "3",
        "--json", str(out), "--png", str(png),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    d = json.loads(out.read_text())
    names = [r["row"] for r in d["rows"]]
    greedy_row = plan[-1][0].replace("(all on)", "(all on, greedy)")
    assert names == ["all off", plan[-1][0], greedy_row, "concurrency 2 (all on)"]
    # the served configuration in every row, the greedy all-on row labelled greedy
    assert [r["sampling"] for r in d["rows"]] == ["default (seed 0)"] * 2 + [
        "greedy (seed 0)",
        "default (seed 0)",
    ]
    assert d["meta"]["sampling"]["default (seed 0)"]["talker"]["do_sample"] is True
    assert d["meta"]["sampling"]["greedy (seed 0)"]["talker"]["do_sample"] is False
    assert d["rows"][-1]["requests"] == 2
    assert d["load"] == []  # no --load: no load rows
    for r in d["rows"]:
        assert r["statuses"] == ["completed"]
        assert r["text_tokens"] == [3]  # fixed length: EOS ignored
        assert r["ttfa_ms"]["median"] > 0 and r["ttft_ms"]["median"] > 0
        assert r["audio_s"]["median"] == pytest.approx((3 * 1920 - 555) / 24000)
    steps = d["rows"][0]["stage_steps"]  # the pipeline's own step log, per stage and kind
    assert steps["thinker.decode"]["count"] >= 2 and steps["code2wav.chunk"]["count"] >= 1
    # greedy text of every row (its greedy pass) equals the plain path's: the optimisations change timing,
    # not results
    assert [r["greedy_text_agreement_vs_all_off"] for r in d["rows"][:3]] == [1.0, 1.0, 1.0]
    forced = d["rows"][1]["greedy_teacher_forced_agreement"]  # per position, against the plain path
    assert forced["agreement"] == 1.0 and forced["positions"] == 3
    assert "greedy_text_agreement_vs_all_off" not in d["rows"][3]  # concurrency rows sample: no check
    # the yield (on in the all-on row) is reported, from the pipeline's log until metrics carry it
    y = d["rows"][1]["thinker_yield"]
    assert y is not None and sum(y["counts"].values()) >= 1 and 0.0 <= y["fraction_first_audio"] <= 1.0
    assert d["rows"][0]["thinker_yield"] is None  # all off: no yield
    det = d["meta"]["determinism"]
    # slots for the determinism check's sessions even with no concurrency rows
    assert set(det) == {"greedy (seed 0)", "default (seed 0)"}
    for v in det.values():
        assert v["bit_identical"] and v["runs"] == 5 and v["text_tokens"] == 3
    assert png.stat().st_size > 10_000


def test_step_summary_groups_by_stage_and_kind():
    rec = types.SimpleNamespace
    steps = [
        rec(stage="thinker", kind="decode", t_start=0.0, t_end=0.010),
        rec(stage="thinker", kind="decode", t_start=0.010, t_end=0.030),
        rec(stage="talker", kind="predict", t_start=0.0, t_end=0.005),
    ]
    s = bench_measure.step_summary(steps)
    assert s["thinker.decode"]["count"] == 2
    assert s["thinker.decode"]["median_ms"] == pytest.approx(15.0)
    assert s["thinker.decode"]["total_ms"] == pytest.approx(30.0)
    assert s["talker.predict"]["median_ms"] == pytest.approx(5.0)


def test_rows_out_of_range_names_the_rows():
    with pytest.raises(SystemExit, match="0: all off"):
        bench.main(["--preset", "tiny", "--device", "cpu", "--rows", "99", "--reference", "off"])


def test_teacher_forced_agreement_counts_positions_not_the_rest_of_the_reply():
    from omni_rt.config import Sampling
    from omni_rt.model.config import preset
    from omni_rt.model.offline import generate_offline
    from omni_rt.model.omni import OmniModel

    model = OmniModel.build(preset("tiny"), weights="random", seed=5)
    greedy = Sampling.greedy()
    prompt = bench.chat_prompt(20, 8)
    with torch.no_grad():
        text, _, _ = generate_offline(
            model, prompt, "ethan", greedy.thinker, greedy.talker, 12, 1, ignore_eos=True
        )
    sample = lambda ids: bench.Sample(len(prompt), 1.0, 1.0, 1.0, len(ids), 1.0, 1.0, 1.0, token_ids=ids)  # noqa: E731
    prompts = {len(prompt): prompt}
    same = bench_checks.teacher_forced_agreement(model, prompts, [sample(text)], greedy)
    assert same == {"agreement": 1.0, "positions": 12, "max_mismatch_ulps": 0.0}
    wrong_last = text[:-1] + [(text[-1] + 1) % 1000 + 2000]
    got = bench_checks.teacher_forced_agreement(model, prompts, [sample(wrong_last)], greedy)
    assert got["agreement"] == pytest.approx(11 / 12) and got["max_mismatch_ulps"] > 2  # no near-tie
    # a wrong token in the middle costs that position; the plain path then reads the row's context
    wrong_mid = text[:5] + [(text[5] + 1) % 1000 + 2000] + text[6:]
    got = bench_checks.teacher_forced_agreement(model, prompts, [sample(wrong_mid)], greedy)
    assert got["agreement"] < 1.0


def test_row_variants_run_beside_all_on_with_their_own_concurrency_rows(tmp_path):
    out = tmp_path / "b.json"
    argv = [
        "--preset", "tiny", "--device", "cpu", "--requests", "1", "--warmup", "0", "--text-tokens", "2",
        "--frames", "2", "--prompts", "8", "--rows", "-1", "--concurrency", "2", "--conc-repeats", "1",
        "--reference", "off", "--no-determinism", "--no-agreement", "--json", str(out),
        "--png", str(tmp_path / "b.png"),
        "--row-variants", '{"starts batched": {"prefill_graph_batches": 2}, "greedy yield": {"yield_until": "frame0"}}',
    ]  # fmt: skip
    assert bench.main(argv) == 0
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    all_on = bench.row_plan("cpu", kernel_ok=False)[-1][0]
    assert list(rows) == [
        all_on, all_on.replace("(all on)", "(all on, greedy)"), "all on + starts batched", "all on + greedy yield",
        "concurrency 2 (all on)", "concurrency 2 (all on + starts batched)", "concurrency 2 (all on + greedy yield)",
    ]  # fmt: skip
    assert rows["all on + starts batched"]["settings"]["prefill_graph_batches"] == 2
    assert rows["all on + greedy yield"]["settings"]["yield_until"] == "frame0"
    assert all(r["statuses"] == ["completed"] for r in rows.values())
    with pytest.raises(SystemExit, match="--row-variants 'x': no such engine setting"):
        bench.main(argv[:-1] + ['{"x": {"no_such_setting": 1}}'])


def test_row_budget_keeps_one_timed_request_per_prompt(tmp_path):
    out = tmp_path / "b.json"
    argv = [
        "--preset", "tiny", "--device", "cpu", "--requests", "3", "--warmup", "0", "--text-tokens", "2",
        "--frames", "2", "--prompts", "8,24", "--rows", "0", "--concurrency", "", "--reference", "off",
        "--no-determinism", "--row-budget-s", "0.001", "--json", str(out), "--png", str(tmp_path / "b.png"),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["requests"] == 2  # the budget is spent after the first request: one per prompt, not 3


def test_yield_outcome_per_response_then_from_the_pipeline_log():
    rec = types.SimpleNamespace
    # the engine's per-response field, where it exists, decides
    got = bench_measure.yield_outcome(
        ["first_audio", "cap", "not_needed", None], None, 0.0, 1.0, "first_audio"
    )
    assert got["counts"] == {"cap": 1, "first_audio": 1, "not_needed": 1}
    assert got["fraction_first_audio"] == pytest.approx(2 / 3)
    # otherwise the pipeline's waits inside the window; "frame0" means first audio under yield_until
    waits = [
        rec(t_start=0.5, t_end=0.51, woke_by="frame0"),
        rec(t_start=0.6, t_end=0.62, woke_by="cap"),
        rec(t_start=0.7, t_end=0.71, woke_by="frame0"),
        rec(t_start=2.0, t_end=2.01, woke_by="cap"),  # another row's: outside the window
    ]
    got = bench_measure.yield_outcome([None, None], waits, 0.0, 1.0, "first_audio")
    assert got["counts"] == {"first_audio": 2, "cap": 1}
    assert got["fraction_first_audio"] == pytest.approx(2 / 3)
    assert got["median_wait_ms"] == pytest.approx(10.0)
    frame0 = bench_measure.yield_outcome([], waits, 0.0, 1.0, "frame0")
    assert frame0["counts"] == {"frame0": 2, "cap": 1} and frame0["fraction_first_audio"] == 0.0
    assert bench_measure.yield_outcome([], waits, 5.0, 6.0, "first_audio") is None  # no yield in the row


def test_playback_lateness_on_time_and_late():
    rate = 1000  # 100 samples = 0.1 s
    # on time: each delta arrives before the audio before it has played
    on_time = [(10.0, 100), (10.05, 100), (10.19, 100), (10.25, 100)]
    late, end = bench_load.playback_lateness(on_time, rate)
    assert late == 0.0 and end == pytest.approx(10.4)
    # the third delta is due at 10.2 and arrives at 10.26: 60 ms late; the reply ends 60 ms after 10.4
    late_one = [(10.0, 100), (10.05, 100), (10.26, 100), (10.27, 100)]
    late, end = bench_load.playback_lateness(late_one, rate)
    assert late == pytest.approx(0.06) and end == pytest.approx(10.46)
    # the largest lateness counts, not the sum; a delta exactly on time is not late
    worst = [(0.0, 100), (0.13, 100), (0.2, 100), (0.45, 100)]
    assert bench_load.playback_lateness(worst, rate)[0] == pytest.approx(0.15)
    assert bench_load.playback_lateness([(0.0, 100), (0.1, 100)], rate)[0] == 0.0
    r = bench_load.Reply(0, 0, 0.0, "completed", lateness_ms=20.0)
    assert not r.late and bench_load.Reply(0, 0, 0.0, "completed", lateness_ms=20.5).late  # > 20 ms
    with pytest.raises(ValueError):
        bench_load.playback_lateness([], rate)


def test_spoken_turn_is_deterministic_speech_like_and_5_s():
    x = bench_load.spoken_turn(seed=0)
    assert x.dtype == np.float32 and x.shape == (80000,) and np.abs(x).max() == pytest.approx(0.5)
    assert np.array_equal(x, bench_load.spoken_turn(seed=0)) and not np.array_equal(
        x, bench_load.spoken_turn(seed=1)
    )
    energy = np.sqrt((x.reshape(-1, 160) ** 2).mean(axis=1))  # 10 ms frames
    assert 0.05 < (energy < 0.005).mean() < 0.5  # pauses between syllables and phrases, mostly voiced
    power = np.abs(np.fft.rfft(x)) ** 2
    f = np.fft.rfftfreq(len(x), 1 / 16000)
    assert power[f < 1000].sum() / power.sum() > 0.5  # voiced energy low in the band, like speech


class _LoadSession:
    """Replies at once: 4 audio deltas of 0.1 s; the `late` conversation's third delta comes 80 ms late."""

    def __init__(self, late):
        self.late, self.requests = late, []

    async def respond(self, **kwargs):
        self.requests.append(kwargs)
        ev = types.SimpleNamespace
        pcm = np.zeros(2400, np.int16)
        for k in range(4):
            await asyncio.sleep(0.28 if (self.late and k == 2) else 0.0)  # due at +0.2 s
            yield ev(type="response.output_audio.delta", pcm=pcm, sample_rate=24000)
        yield ev(type="response.done", status="completed", metrics=ev(thinker_yield="first_audio"))


class _LoadEngine:
    def __init__(self):
        self.sessions, self.settings = [], types.SimpleNamespace(yield_until="first_audio")

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        pass

    def session(self, voice):
        s = _LoadSession(late=len(self.sessions) == 3)  # the level's warm-up takes sessions 0 and 1
        self.sessions.append(s)

        class _Ctx:
            async def __aenter__(self_):
                return s

            async def __aexit__(self_, *exc):
                pass

        return _Ctx()


def test_load_conversations_loop_play_and_pause(monkeypatch):
    # the protocol's 3 s stagger and 1-3 s pauses, shortened so the loop turns over in a test
    monkeypatch.setattr(bench_load, "STAGGER_S", 0.05)
    monkeypatch.setattr(bench_load, "PAUSE_S", (0.01, 0.02))
    engine = _LoadEngine()
    plan = bench_load.LoadPlan(text_tokens=3, frames=5, prompt=[1, 2, 3], seed=7)
    args = types.SimpleNamespace(seed=7, load_seconds=1.2)
    rows = asyncio.run(bench_load.run_levels(engine, [2], plan, args))
    (row,) = rows
    assert row["conversations"] == 2 and row["failed"] == 0
    # each reply plays 0.4 s (0.48 s late), then a pause: 2-3 turns per conversation in 1.2 s
    on_time, late = engine.sessions[2].requests, engine.sessions[3].requests
    assert len(engine.sessions) == 4 and len(engine.sessions[0].requests) == 1  # a warm-up reply each
    assert 2 <= len(on_time) <= 3 and 2 <= len(late) <= 3 and row["replies"] == len(on_time) + len(late)
    assert row["late_replies"] == len(late)  # 80 ms late each time; the other conversation never
    assert 75 < row["lateness_ms"]["max"] < 500 and row["lateness_ms"]["p50"] >= 0.0  # ~80 ms, + jitter
    assert row["ttfa_ms"]["max"] < 200  # first audio came at once (a busy CI machine may add jitter)
    assert row["wall_s"] >= 1.2 and row["audio_s_per_s"] == pytest.approx(row["audio_s"] / row["wall_s"])
    assert row["thinker_yield"]["fraction_first_audio"] == 1.0  # read from the per-response field
    assert set(row["collector"]) == {"full", "full_max_ms", "full_ms", "young_ms"}  # the level's collections
    # what every turn asks: the fixed lengths, EOS ignored, the seeded default sampling, its own seed
    req = on_time[0]
    assert req["input_ids"] == [1, 2, 3] and req["ignore_eos"] is True
    assert (req["max_output_tokens"], req["max_audio_frames"]) == (3, 5)
    assert req["sampling"].talker.do_sample and req["sampling"].seed is not None
    seeds = {r["sampling"].seed for r in on_time + late}
    assert len(seeds) == len(on_time) + len(late)  # not the same draws in every turn and conversation


def test_load_rotates_a_session_whose_context_is_full():
    ids = TokenIds()
    turn = [ids.im_start, ids.user, ids.newline, 5, 6, ids.im_end, ids.newline, ids.im_start, ids.assistant]
    settings = types.SimpleNamespace(max_context=64, max_talker_context=64)
    s = types.SimpleNamespace(conversation=turn * 3, ids=ids, engine=types.SimpleNamespace(settings=settings))
    assert bench_load._fits(s, None, frames=4)  # the first turn: nothing to go by
    assert bench_load._fits(s, (20, 7), frames=4)  # 27 + 20 + 8 < 64
    assert not bench_load._fits(s, (40, 7), frames=4)  # the Thinker's context would overflow
    assert not bench_load._fits(s, (20, 7), frames=40)  # the reply's frames would be cut to fit the Talker


def test_select_rows_load_alone_runs_no_protocol_rows():
    plan = bench.row_plan("cpu", kernel_ok=False)
    sel = lambda rows, load: bench._select_rows(types.SimpleNamespace(rows=rows, load=load), plan)  # noqa: E731
    assert sel(None, "") == plan and sel(None, "1,8") == [] and sel("all", "1,8") == plan
    assert sel("0", "1,8") == plan[:1]
    assert sel("-1", "") == plan[-1:] and sel("0,-1", "") == [plan[0], plan[-1]]  # -1: all on
    with pytest.raises(SystemExit, match="--load"):
        bench_load.parse_levels("1,x")
    with pytest.raises(SystemExit, match="1..256"):
        bench_load.parse_levels("0")


def test_load_smoke_tiny_cpu(tmp_path, monkeypatch):
    # a real engine, N = 2, a few seconds; the stagger and pauses shortened so each conversation loops
    monkeypatch.setattr(bench_load, "STAGGER_S", 0.3)
    monkeypatch.setattr(bench_load, "PAUSE_S", (0.05, 0.1))
    out, png = tmp_path / "l.json", tmp_path / "l.png"
    argv = [
        "--preset", "tiny", "--device", "cpu", "--text-tokens", "2", "--frames", "2", "--load", "2",
        "--load-seconds", "2", "--json", str(out), "--load-png", str(png), "--load-trace",
    ]  # fmt: skip
    assert bench.main(argv) == 0
    d = json.loads(out.read_text())
    assert d["rows"] == []  # --load alone: only the load rows
    (row,) = d["load"]
    assert row["conversations"] == 2 and row["failed"] == 0 and row["replies"] >= 2
    assert row["turns"] == "text" and row["sampling"] == "default"
    assert row["ttfa_ms"]["p50"] > 0 and row["lateness_ms"]["max"] >= 0.0
    assert 0 <= row["late_replies"] <= row["replies"] and row["audio_s_per_s"] > 0
    assert row["audio_s"] == pytest.approx(row["replies"] * (2 * 1920 - 555) / 24000)  # every frame played
    assert d["meta"]["load_engine"]["max_sessions"] == 2
    assert png.stat().st_size > 10_000
    # --load-trace: each reply's audio arrivals, and the pipeline's steps that served it
    trace = row["trace"]
    assert len(trace["responses"]) == row["replies"]
    for k, r in enumerate(trace["responses"]):
        assert r["id"].startswith("resp_") and sum(n for _, n in r["arrivals"]) == 2 * 1920 - 555
        kinds = {(st[0], st[1]) for st in trace["steps"] if k in st[4]}
        assert {("thinker", "prefill"), ("talker", "predict"), ("code2wav", "chunk")} <= kinds
        assert all(0.0 <= st[2] <= st[3] for st in trace["steps"])


def test_load_variants_run_the_protocol_once_each_on_the_same_weights(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_load, "STAGGER_S", 0.1)
    out = tmp_path / "v.json"
    argv = [
        "--preset", "tiny", "--device", "cpu", "--text-tokens", "2", "--frames", "2", "--load", "1",
        "--load-seconds", "0.5", "--json", str(out), "--load-png", str(tmp_path / "v.png"),
        "--load-variants", '{"served": {}, "lead off": {"urgent_text_lead": null}}',
    ]  # fmt: skip
    assert bench.main(argv) == 0
    d = json.loads(out.read_text())
    assert [r["variant"] for r in d["load"]] == ["served", "lead off"]
    assert d["meta"]["load_variants"]["lead off"] == {"urgent_text_lead": None}
    assert all(r["replies"] >= 1 and r["failed"] == 0 for r in d["load"])
    assert "lead off" in capsys.readouterr().out  # the table says which variant a row is
    for bad in ('{"x": {"no_such_setting": 1}}', "[1]", "{"):
        with pytest.raises(SystemExit, match="--load-variants"):
            bench.parse_variants(bad)
    assert bench.parse_variants(None) == {"served": {}}


def test_set_overrides_parse_as_json_and_reject_unknown_settings():
    from omni_rt.bench import parse_sets

    assert parse_sets(["urgent_text_lead=null", "max_text_lead=8", "handoff=event"]) == {
        "urgent_text_lead": None,
        "max_text_lead": 8,
        "handoff": "event",
    }
    for bad in (["no_such_setting=1"], ["max_text_lead"]):
        with pytest.raises(SystemExit, match="KEY=VALUE"):
            parse_sets(bad)


def test_a_stalled_engine_ends_the_run_with_what_was_measured(tmp_path, monkeypatch):
    # a stage stuck inside the device would hold a normal exit (and the next row's engine) until the
    # call's time limit: the run saves its rows with the stall and exits 3 at once
    from omni_rt import bench_output
    from omni_rt.errors import EngineStalledError

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(bench_output.os, "_exit", exit_now)
    path = tmp_path / "b.json"
    healthy = types.SimpleNamespace(stall=None)
    bench_output.exit_if_stalled(healthy, str(path), {}, [{"row": "a"}], [])
    assert not path.exists()  # nothing to do for an engine that is fine
    stalled = types.SimpleNamespace(stall=EngineStalledError("the talker stage has not returned for 31 s"))
    with pytest.raises(SystemExit) as stop:
        bench_output.exit_if_stalled(
            stalled, str(path), {"date": "d"}, [{"row": "a"}], [{"conversations": 8}]
        )
    saved = json.loads(path.read_text())
    assert stop.value.code == 3 and "talker stage" in saved["meta"]["stall"]
    assert saved["rows"] == [{"row": "a"}] and saved["load"] == [{"conversations": 8}]
