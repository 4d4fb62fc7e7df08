"""`omni-rt bench`: the one benchmark protocol (shared/reference/performance.md), through the public API.

    omni-rt bench                                   # real shapes, random bf16 weights, one CUDA GPU
    omni-rt bench --preset tiny --device cpu --requests 1 --text-tokens 4 --frames 4   # CI smoke
    omni-rt bench --load 1,8,16,32,64               # the load protocol only (omni_rt.bench_load)
    omni-rt bench --rows all --load 1,8,16,32       # both in one run

Three chat prompts (a 20-id system turn, then user turns of 8, 24 and 64 ids; built as ids, no tokenizer),
each run `--requests` times after `--warmup` warm-up requests, at fixed lengths (64 text tokens, 64 codec
frames, end-of-sequence ignored). Per request: TTFT (respond() to the first text delta received), TTFA (to
the first audio delta), text tok/s (decode tokens after the first over their time), RTF (respond() to
response.done over the audio's duration), and the engine's per-stage timestamps. Rows, side by side: the
reference implementation (transformers' `generate` on the same weights, same lengths; greedy), this engine
with every optimisation off, each optimisation added in turn, all on, and all on greedy; then concurrency
rows (1, 4, 8 simultaneous sessions, all on). Output: a table on stdout, JSON (`--json`) and a PNG chart
(`--png`).

Sampling: every row runs the served configuration, the Session's default `Sampling()` with a fixed seed
(`--seed`); the greedy all-on row beside it is labelled greedy. The checks that need one right token per
position (text agreement with 'all off', teacher-forced agreement) run on an extra greedy pass of each row
(one request per prompt, untimed); the determinism check runs greedy and seeded-sampled, each labelled.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import gc
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from omni_rt.bench_measure import Pass, Sample, bench_engine, chat_prompt, sampling_label, summarise
from omni_rt.bench_output import commit_id, exit_if_stalled, format_table, plot, print_checks, save_json
from omni_rt.bench_plan import (
    _greedy_name,
    _select_rows,
    _settings,
    parse_sets,
    parse_variants,
    row_plan,
    row_variants,
)
from omni_rt.bench_reference import reference_model, reference_samples
from omni_rt.model.config import TokenIds

# what scripts and tests import from here: the prompt layout and the reference on shared weights
__all__ = ["chat_prompt", "format_table", "main", "reference_model", "reference_samples", "row_plan"]

# ------------------------------------------------------------------------------------------------------
# Rows


def _engine_model(engine: Any) -> torch.nn.Module | None:
    for name in ("model", "_model", "omni"):
        m = getattr(engine, name, None)
        if isinstance(m, torch.nn.Module):
            return m
    return None


def _load_engine(args: argparse.Namespace, settings: Any, first: Any = None) -> Any:
    """The first row loads the model (`Engine.load`); later rows wrap the same model in a new Engine
    with their settings, so the weights are built once per run."""
    import omni_rt

    if first is None:
        kwargs: dict[str, Any] = dict(device=args.device, dtype=args.dtype, settings=settings, seed=args.seed)
        if args.random_weights:
            kwargs["random_weights"] = True
        return omni_rt.Engine.load(args.preset, **kwargs)
    model = first.model

    def stages(s: Any) -> Any:
        from omni_rt.pipeline.runners import build_runners

        return build_runners(model, s)

    return omni_rt.Engine(first.cfg, first.tokenizer, stages, settings, model=model, name=first.name)


# ------------------------------------------------------------------------------------------------------
# Entry point


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="omni-rt bench",
        description="The omni_rt benchmark protocol: one row per optimisation switch (all off, each on, all "
        "on), concurrency rows and the reference implementation, timed per request; a table on stdout, "
        "--json and --png written at the end. The real shapes need a CUDA GPU; on a CPU try "
        "--preset tiny --device cpu --requests 1.",
    )
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b", help="preset name or checkpoint dir")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda or cpu (default: cuda if any)",
    )
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument(
        "--no-random-weights",
        dest="random_weights",
        action="store_false",
        help="load --preset as a checkpoint directory's weights (default: seeded random weights)",
    )
    ap.add_argument("--requests", type=int, default=5, help="timed requests per prompt")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests per prompt")
    ap.add_argument(
        "--warmup-once", action="store_true", help="warm up on the first prompt only (saves GPU time)"
    )
    ap.add_argument(
        "--row-budget-s",
        type=float,
        default=0.0,
        help="stop a row's timed requests after this many seconds, one per prompt at least (0: no limit; "
        "the slow rows then show fewer requests in the n column)",
    )
    ap.add_argument("--text-tokens", type=int, default=64, help="text tokens per reply (fixed length)")
    ap.add_argument(
        "--frames", type=int, default=64, help="codec frames per reply, 80 ms each (fixed length)"
    )
    ap.add_argument("--system-len", type=int, default=20, help="system-turn length in ids")
    ap.add_argument("--prompts", default="8,24,64", help="user-turn lengths in ids")
    ap.add_argument(
        "--rows",
        default=None,
        help="'all' (the default without --load), 'none' (reference only) or comma-separated indices of the "
        "rows (negative from the end: -1 is all on); with --load and no --rows only the load protocol runs",
    )
    ap.add_argument(
        "--concurrency", default="1,4,8", help="simultaneous sessions for the all-on rows; '' none"
    )
    ap.add_argument("--conc-repeats", type=int, default=2, help="rounds of each concurrency row")
    ap.add_argument(
        "--agreement",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a greedy pass per row (one untimed request per prompt) for the agreement checks",
    )
    ap.add_argument(
        "--reference",
        choices=("auto", "on", "off"),
        default="auto",
        help="time the reference implementation's generate too (auto: where it is installed)",
    )
    ap.add_argument("--reference-requests", type=int, default=1, help="per prompt (generate is slow)")
    ap.add_argument(
        "--reference-warmup", type=int, default=1, help="short warm-up generate calls, first prompt"
    )
    ap.add_argument(
        "--determinism",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the rows: all on + deterministic=True, the same request alone and concurrently, bits "
        "compared, greedy and seeded-sampled",
    )
    ap.add_argument(
        "--determinism-concurrency", type=int, default=4, help="sessions of the determinism check"
    )
    ap.add_argument(
        "--load", default="", help="the load protocol's levels (conversations), e.g. 1,8,16,32,64"
    )
    ap.add_argument("--load-seconds", type=float, default=30.0, help="wall time of each load level")
    ap.add_argument("--load-speech", action="store_true", help="5 s spoken turns instead of the text prompt")
    ap.add_argument("--load-sampling", choices=("default", "greedy"), default="default")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine setting of the load engine, over all on (VALUE as JSON: urgent_text_lead=null); "
        "repeat for more",
    )
    ap.add_argument(
        "--load-variants",
        default=None,
        help='the load protocol once per variant, in one run (the weights built once): JSON {"name": '
        '{"setting": value, ...}, ...}, each over all on and --set; rows and table say the variant',
    )
    ap.add_argument(
        "--row-variants",
        default=None,
        help='rows beside the all-on row, in one run: JSON {"name": {"setting": value, ...}, ...}, each '
        "all on plus its settings, timed as all on, with its own --concurrency rows (no greedy pass)",
    )
    ap.add_argument("--load-user-len", type=int, default=24, help="user-turn ids of the load prompt (57 ids)")
    ap.add_argument("--load-png", default="bench-load.png", help="where the load chart goes")
    ap.add_argument(
        "--load-trace", action="store_true",
        help="add each level's timeline to its JSON row (audio arrivals of every reply, the pipeline's steps): "
        "what ran while a reply was late (omni_rt.bench_load.level_trace)",
    )  # fmt: skip
    ap.add_argument(
        "--speech-turn",
        action="store_true",
        help="the spoken-question rows, in real time (omni_rt.bench_speech)",
    )
    ap.add_argument("--speech-seconds", type=float, default=5.0, help="length of the spoken question")
    ap.add_argument(
        "--speech-wav",
        default=None,
        help="a recording of the spoken question (mono WAV, 16-bit) instead of espeak-ng's: for a machine "
        "without espeak-ng, or your own voice",
    )
    ap.add_argument("--speech-requests", type=int, default=3, help="timed requests per speech row")
    ap.add_argument("--speech-warmup", type=int, default=1, help="warm-up requests per speech row")
    ap.add_argument("--voice", default="ethan", help="speaker of every reply")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and sampling")
    ap.add_argument("--json", default="bench.json", help="where the rows go as JSON (default: bench.json)")
    ap.add_argument("--png", default="bench.png", help="where the chart goes (default: bench.png)")
    args = ap.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.load_seconds <= 0:
        ap.error("--load-seconds must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from omni_rt.bench_checks import determinism_check, teacher_forced_agreement, token_agreement
    from omni_rt.config import Sampling
    from omni_rt.engine import apply_kernels, triton_runs

    ids_cfg = TokenIds()
    prompts = [chat_prompt(args.system_len, int(n), args.seed, ids_cfg) for n in args.prompts.split(",") if n]
    # the served configuration (the Session's default sampling, seeded) for every row; greedy beside it
    served, greedy = Sampling(seed=args.seed), Sampling.greedy(seed=args.seed)
    served_label, greedy_label = sampling_label("default", args.seed), sampling_label("greedy", args.seed)
    kernel_ok = triton_runs(torch.device(args.device))
    if args.device.startswith("cuda") and not kernel_ok:
        print("[bench] the Triton kernels cannot run here: no kernel rows", file=sys.stderr)
    full_plan = row_plan("cpu" if args.device == "cpu" else "cuda", kernel_ok)
    plan = _select_rows(args, full_plan)
    timed = len(plan) - 1  # the last selected row (all on by default): its greedy pass and concurrency
    plan = plan + row_variants(args, full_plan, plan)  # beside it, with its concurrency rows
    levels = []
    if args.load:
        from omni_rt.bench_load import parse_levels

        levels = parse_levels(args.load)
    concurrency = [int(c) for c in args.concurrency.split(",") if c] if plan else []
    determinism = args.determinism and bool(plan)
    # caches sized for this run: the longest prompt plus its output, and the largest concurrency
    longest = max(len(p) for p in prompts) + args.text_tokens + 8
    base = dict(
        max_sessions=max([1, *concurrency, max(2, args.determinism_concurrency) if determinism else 1]),
        max_context=max(64, longest),
        max_talker_context=max(64, longest + args.frames),
    )
    meta = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": commit_id(),
        "device": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "args": vars(args),
        "prompt_lengths": [len(p) for p in prompts],
        "sampling": {served_label: served.model_dump(), greedy_label: greedy.model_dump()},
    }
    rows: list[dict[str, Any]] = []
    conc_rows: list[dict[str, Any]] = []
    load_rows: list[dict[str, Any]] = []
    first = None  # the first engine: later rows reuse its model
    greedy_samples: dict[str, list[Sample]] = {}  # per row: its greedy requests, for the agreement checks
    for idx, (name, overrides) in enumerate(plan):
        settings = _settings(base, overrides)
        t_load = time.perf_counter()
        engine = _load_engine(args, settings, first)
        if first is not None:  # a model shared with earlier rows: their kernels off, this row's on
            apply_kernels(first.model, settings)
        load_s = time.perf_counter() - t_load
        print(f"[bench] {name}: engine ready in {load_s:.1f} s", file=sys.stderr, flush=True)
        last = idx == timed
        passes = [Pass("served", served)]
        if last:  # the greedy row beside the all-on row, timed like it
            passes.append(Pass("greedy", greedy))
        elif args.agreement:
            passes.append(Pass("greedy", greedy, timed=False))
        t_row = time.perf_counter()
        try:
            results, conc = asyncio.run(
                bench_engine(engine, prompts, args, passes, concurrency if idx >= timed else (), served)
            )
        except Exception:
            exit_if_stalled(engine, args.json, meta, rows + conc_rows, load_rows)
            raise
        row_s = time.perf_counter() - t_row
        res, g = results["served"], results.get("greedy")
        new = [
            summarise(
                name, res.samples, sampling=served_label, settings=overrides, load_s=load_s,
                stage_steps=res.steps, thinker_yield=res.thinker_yield,
            )
        ]  # fmt: skip
        if g is not None:
            greedy_samples[name] = g.samples
        if last and g is not None:
            new.append(
                summarise(
                    _greedy_name(name), g.samples, sampling=greedy_label, settings=overrides,
                    stage_steps=g.steps, thinker_yield=g.thinker_yield,
                )
            )  # fmt: skip
            greedy_samples[new[-1]["row"]] = g.samples
        rows += new
        brief = ", ".join(f"{k} {v['count']}x{v['median_ms']:.2f}ms" for k, v in res.steps.items())
        print(f"[bench]   steps: {brief}", file=sys.stderr, flush=True)
        print(f"[bench] {name}: {row_s:.1f} s", file=sys.stderr, flush=True)
        for line in format_table(new).splitlines()[2:]:
            print(line, file=sys.stderr, flush=True)
        for c, (cs, agg, y) in conc.items():
            conc_rows.append(
                summarise(
                    f"concurrency {c} ({'all on' if last else name})", cs, sampling=served_label,
                    aggregate_text_tok_s=agg, thinker_yield=y,
                )
            )  # fmt: skip
        save_json(args.json, meta, rows + conc_rows, load_rows)  # partial results survive a run cut short
        if first is None:
            first = engine
    rows += conc_rows
    # greedy text of each row against the plain path (every optimisation off), per prompt
    if "all off" in greedy_samples:
        for r in rows:
            if r["row"] in greedy_samples:
                r["greedy_text_agreement_vs_all_off"] = token_agreement(
                    greedy_samples[r["row"]], greedy_samples["all off"]
                )
    # per position, against the plain path itself (no kernels, no graphs), given each row's greedy text
    if first is not None and greedy_samples:
        apply_kernels(first.model, _settings(base, {}))
        by_len = {len(p): p for p in prompts}
        for r in rows:
            if r["row"] in greedy_samples:
                r["greedy_teacher_forced_agreement"] = teacher_forced_agreement(
                    first.model, by_len, greedy_samples[r["row"]], greedy
                )

    det = None
    if determinism and first is not None:
        settings = _settings(base, plan[-1][1] | {"deterministic": True})
        engine = _load_engine(args, settings, first)
        apply_kernels(first.model, settings)
        det = asyncio.run(
            determinism_check(
                engine, prompts[len(prompts) // 2], args, {greedy_label: greedy, served_label: served}
            )
        )
        meta["determinism"] = det

    if levels:
        from omni_rt.bench_load import format_load_table, load_prompt, load_settings, plot_load, run_load

        sizes = load_settings(args, levels, len(load_prompt(args)))
        meta["load_engine"] = sizes | parse_sets(args.set)
        variants = parse_variants(args.load_variants)
        if len(variants) > 1 or "served" not in variants:
            meta["load_variants"] = variants
        for name, overrides in variants.items():
            # all on, a slot per conversation, then --set, then the variant's own settings
            settings = _settings(sizes, full_plan[-1][1] | parse_sets(args.set) | overrides)
            t_load = time.perf_counter()
            engine = _load_engine(args, settings, first)
            if first is not None:
                apply_kernels(first.model, settings)
            print(
                f"[bench] load {name}: engine ready in {time.perf_counter() - t_load:.1f} s", file=sys.stderr
            )

            def saved(row: dict[str, Any], name: str = name, engine: Any = engine) -> None:
                row["variant"] = name
                save_json(args.json, meta, rows, load_rows + [row])
                load_rows.append(row)
                exit_if_stalled(engine, args.json, meta, rows, load_rows)

            try:
                run_load(args, engine, saved)
            except Exception:
                exit_if_stalled(engine, args.json, meta, rows, load_rows)
                raise
            first = first or engine
            if engine is not first:
                del engine  # its caches and graphs go before the next variant's are built
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()

    speech_rows: list[dict[str, Any]] = []
    if args.speech_turn:
        from omni_rt.bench_speech import format_speech_table, run_speech_rows

        def speech_engine(overrides: dict[str, Any]) -> Any:
            nonlocal first
            sizes = {"max_sessions": 2, "max_context": 1024, "max_talker_context": 1024}
            settings = _settings(sizes, full_plan[-1][1] | overrides)  # all on, but for `overrides`
            engine = _load_engine(args, settings, first)
            if first is not None:
                apply_kernels(first.model, settings)
            first = first or engine
            return engine

        speech_rows = run_speech_rows(args, speech_engine)
        meta["speech"] = speech_rows
        print(format_speech_table(speech_rows))

    want_ref = args.reference == "on" or (
        args.reference == "auto" and args.device.startswith("cuda") and (plan or args.rows == "none")
    )
    if want_ref:
        rows.insert(0, _reference_row(args, first, prompts))
    del first
    gc.collect()

    if rows:
        print(format_table(rows))
        print_checks(rows, det)
    if load_rows:
        print(format_load_table(load_rows))
    save_json(args.json, meta, rows, load_rows)
    title = f"omni-rt bench · {args.preset} · {meta['device']} · {meta['commit']}"
    try:
        if args.png and rows:
            plot(rows, Path(args.png), title)
        if args.load_png and load_rows:
            plot_load(load_rows, Path(args.load_png), title + " · load")
    except ImportError as exc:
        print(f"[bench] no chart: {exc}", file=sys.stderr)
    return 0


def _reference_row(args: argparse.Namespace, first: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """transformers' `generate` on the same weights (greedy: see omni_rt.bench_reference)."""
    name = "reference (transformers generate)"
    model = _engine_model(first) if first is not None else None
    if model is None and first is None:  # reference-only run: the same seeded weights Engine.load builds
        from omni_rt.model.config import preset
        from omni_rt.model.omni import OmniModel

        model = OmniModel.build(
            preset(args.preset), device=args.device, dtype=args.dtype, weights="random", seed=args.seed
        )
    if model is None:
        return {"row": name, "skipped": "engine exposes no model"}
    try:
        samples, why = reference_samples(model, prompts, args)
    except Exception as exc:  # noqa: BLE001 - the reference row must not sink the engine's rows
        samples, why = [], f"{type(exc).__name__}: {exc}"
    if why:
        return {"row": name, "skipped": why}
    return summarise(name, samples, sampling="greedy (generate's own)")


if __name__ == "__main__":
    raise SystemExit(main())
