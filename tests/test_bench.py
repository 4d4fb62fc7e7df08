"""The benchmark: prompt layout, per-request timing, row plan, summaries, the reference on shared
weights, and the whole `omni-rt bench` on the tiny preset on the CPU (the CI smoke run)."""

import asyncio
import json
import types

import numpy as np
import pytest
import torch

from omni_rt import bench
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
    r = asyncio.run(bench.timed_request(s, [1, 2, 3], text_tokens=9, frames=4, sampling=None))
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
    assert bench.token_agreement(a, b) == pytest.approx((3 / 4 + 2 / 3) / 2)
    assert bench.token_agreement(a, a) == 1.0


def test_summarise_medians_min_max_and_median_request():
    mk = lambda ttfa: bench.Sample(57, 1.0, ttfa, 100.0, 64, 5.1, 100.0, 0.02)  # noqa: E731
    row = bench.summarise("x", [mk(30.0), mk(10.0), mk(20.0)])
    assert row["ttfa_ms"] == {"median": 20.0, "min": 10.0, "max": 30.0}
    assert row["median_request"]["ttfa_ms"] == 20.0
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
    assert "+ cuda graphs" not in cpu and "+ prefill graphs" not in cpu
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
    )
    assert EngineSettings.all_off(**cpu_last).model_dump() == gpu_only_off.model_dump()


def test_reference_model_shares_our_weights_and_matches_logits():
    pytest.importorskip("transformers")
    from omni_rt.model.config import preset
    from omni_rt.model.omni import OmniModel

    cfg = preset("tiny")
    model = OmniModel.build(cfg, weights="random", seed=3)
    ref, info = bench.reference_model(model)
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
    assert names == ["all off", plan[-1][0], "concurrency 2 (all on)"]
    assert d["rows"][-1]["requests"] == 2
    for r in d["rows"]:
        assert r["statuses"] == ["completed"]
        assert r["text_tokens"] == [3]  # fixed length: EOS ignored
        assert r["ttfa_ms"]["median"] > 0 and r["ttft_ms"]["median"] > 0
        assert r["audio_s"]["median"] == pytest.approx((3 * 1920 - 555) / 24000)
    steps = d["rows"][0]["stage_steps"]  # the pipeline's own step log, per stage and kind
    assert steps["thinker.decode"]["count"] >= 2 and steps["code2wav.chunk"]["count"] >= 1
    # greedy text of every row equals the plain path's (the optimisations change timing, not results)
    assert d["rows"][1]["token_agreement_vs_all_off"] == 1.0
    forced = d["rows"][1]["teacher_forced_agreement"]  # per position, against the plain path
    assert forced["agreement"] == 1.0 and forced["positions"] == 3
    det = d["meta"]["determinism"]
    # slots for the determinism check's sessions even with no concurrency rows
    assert det["bit_identical"] and det["runs"] == 5 and det["text_tokens"] == 3
    assert png.stat().st_size > 10_000


def test_step_summary_groups_by_stage_and_kind():
    rec = types.SimpleNamespace
    steps = [
        rec(stage="thinker", kind="decode", t_start=0.0, t_end=0.010),
        rec(stage="thinker", kind="decode", t_start=0.010, t_end=0.030),
        rec(stage="talker", kind="predict", t_start=0.0, t_end=0.005),
    ]
    s = bench.step_summary(steps)
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
    same = bench.teacher_forced_agreement(model, prompts, [sample(text)], greedy)
    assert same == {"agreement": 1.0, "positions": 12, "max_mismatch_ulps": 0.0}
    wrong_last = text[:-1] + [(text[-1] + 1) % 1000 + 2000]
    got = bench.teacher_forced_agreement(model, prompts, [sample(wrong_last)], greedy)
    assert got["agreement"] == pytest.approx(11 / 12) and got["max_mismatch_ulps"] > 2  # no near-tie
    # a wrong token in the middle costs that position; the plain path then reads the row's context
    wrong_mid = text[:5] + [(text[5] + 1) % 1000 + 2000] + text[6:]
    got = bench.teacher_forced_agreement(model, prompts, [sample(wrong_mid)], greedy)
    assert got["agreement"] < 1.0


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
