"""Where a Code2Wav chunk's time goes at the real shapes: graphed step times per (rows, frames), the
kernels of one step by name, and what `torch.compile` of the step would give.

    PYTHONUNBUFFERED=1 python scripts/gpu_code2wav.py --out $OUT/gpu_code2wav.json

Builds the `qwen3-omni-30b-a3b` Code2Wav alone (random bf16 weights), then for each set of fused kernels
in `--variants` (default: "snake,rmsnorm" and "snake,rmsnorm,code2wav"):
- graphed `Code2Wav.step` replays for rows 1, 4, 8, 16 and chunks of 1, 2, 4, 8, 16 frames (CUDA events,
  median of 5 blocks of 10), and the largest difference from the first variant's PCM of a 2-row stream of
  graphed chunks of several sizes (`STREAM_CHUNKS`), restarted midway;
- one eager step under the profiler at (1 row, 1 frame), (1, 16) and (8, 16): kernels per step, and the
  kernels' GPU time grouped by name (the top ones printed);
- with `--compile`: the step through `torch.compile` (fresh state per shape), compile seconds, graphed
  replay times, and the largest difference from the eager step's PCM;
- with `--layouts`: each conv shape of the decoder alone, its input and weight as now ([B, C, T]
  contiguous) against time-major ([B, T, C] contiguous, seen as [B, C, T]; weights likewise) and a 1x1
  conv as a linear: kernels per call and graphed time.
- with `--ragged`: the served runner (`Code2WavRunner`, graphs, fused kernels) decoding 4 responses'
  chunks of different sizes in one call each (ragged), against each response decoded alone: the largest
  PCM difference; and a graphed ragged step's time beside the same shape with every row full.
`--device cpu --preset tiny` checks the script's logic.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_rt.model.code2wav import Code2Wav  # noqa: E402
from omni_rt.model.config import preset  # noqa: E402
from omni_rt.model.weights import init_random  # noqa: E402
from omni_rt.pipeline.graphs import capture  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_stages import time_fn  # noqa: E402


def time_ms(fn, blocks=5, reps=10) -> float:
    """`gpu_stages.time_fn`'s median of blocks of replays between CUDA events, in ms."""
    return time_fn(fn, blocks=blocks, reps=reps)


def graphed_step(c2w, step, rows, n, dev, valid=None):
    state = c2w.new_state(rows)
    if valid is not None:  # a ragged step: each row's own frames
        state.valid = torch.tensor(valid, device=dev)
    codes = torch.randint(0, c2w.cfg.codebook_size, (rows, c2w.cfg.num_quantizers, n), device=dev)
    g = capture(lambda c: step(c, state), (codes,)) if dev.type == "cuda" else (lambda c: step(c, state))
    return lambda: g(codes), state, codes


STREAM_CHUNKS = (1, 2, 4, 3, 1, 8, 16)  # 3: a size without a graph (graphed pieces in the runner)


def stream_pcm(c2w, dev) -> torch.Tensor:
    """A 2-row stream through graphed steps (one graph per size, sharing one state), restarted before its
    5th chunk: every step's context and ring updates feed the next, so a wrong update shows in the PCM."""
    torch.manual_seed(1)
    state = c2w.new_state(2)
    codes = torch.randint(
        0, c2w.cfg.codebook_size, (2, c2w.cfg.num_quantizers, sum(STREAM_CHUNKS)), device=dev
    )
    step = lambda c: c2w.step(c, state)  # noqa: E731
    graphs_by_size = {
        n: capture(step, (codes[..., :n].clone(),)) if dev.type == "cuda" else step
        for n in set(STREAM_CHUNKS)
    }
    state.reset()  # capturing ran steps on it
    out, t = [], 0
    for i, n in enumerate(STREAM_CHUNKS):
        if i == 4:
            state.reset()
        out.append(graphs_by_size[n](codes[..., t : t + n]).clone())
        t += n
    return torch.cat(out, dim=-1)


def profile_step(c2w, rows, n, dev) -> dict:
    state = c2w.new_state(rows)
    codes = torch.randint(0, c2w.cfg.codebook_size, (rows, c2w.cfg.num_quantizers, n), device=dev)
    c2w.step(codes, state)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as prof:
        c2w.step(codes, state)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    n_kernels = 0
    for ev in prof.events():
        if dev.type == "cuda" and ev.device_type == torch.autograd.DeviceType.CUDA:
            n_kernels += 1
            rec = by_name[ev.name[:90]]
            rec[0] += 1
            rec[1] += ev.device_time / 1e3  # ms
    total = sum(r[1] for r in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:14]
    return dict(
        rows=rows, frames=n, kernels=n_kernels, kernel_ms=total,
        top=[dict(name=k, count=v[0], ms=v[1]) for k, v in top],
    )  # fmt: skip


def kernels_of(fn, dev) -> int:
    if dev.type != "cuda":
        return 0
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA)


def layouts(c2w, dev, res) -> None:
    """Each causal / transposed conv of the decoder at its real input length for (rows, frames)."""
    from omni_rt.model.code2wav import CausalTransConv1d

    F = torch.nn.functional
    rate = {}  # module -> input samples per frame
    r = 4  # after the upsampler
    for block in c2w.decoder[1:-2]:
        rate[block.block[1]] = r
        r *= block.block[1].stride
        for unit in block.block[2:]:
            rate[unit.conv1] = rate[unit.conv2] = r
    rate[c2w.decoder[0]], rate[c2w.decoder[-1]] = 4, r
    res["layouts"] = []
    for rows, n in ((1, 1), (1, 16), (8, 16)):
        tot = collections.Counter()
        for mod, spf in rate.items():
            cv = mod.conv
            T = spf * n + getattr(mod, "context", 0)
            x = torch.randn(rows, cv.in_channels, T, device=dev, dtype=cv.weight.dtype)
            xt = x.transpose(1, 2).contiguous().transpose(1, 2)
            wt = cv.weight.detach().transpose(1, 2).contiguous().transpose(1, 2)
            if isinstance(mod, CausalTransConv1d):
                now = lambda x=x, cv=cv: F.conv_transpose1d(x, cv.weight, cv.bias, stride=cv.stride)  # noqa: E731
                tm = lambda xt=xt, wt=wt, cv=cv: F.conv_transpose1d(xt, wt, cv.bias, stride=cv.stride)  # noqa: E731
            else:
                now = lambda x=x, cv=cv: F.conv1d(x, cv.weight, cv.bias, dilation=cv.dilation)  # noqa: E731
                tm = lambda xt=xt, wt=wt, cv=cv: F.conv1d(xt, wt, cv.bias, dilation=cv.dilation)  # noqa: E731
            variants = {"now": now, "time-major": tm}
            if cv.kernel_size[0] == 1:
                w2 = cv.weight.detach()[:, :, 0].contiguous()
                xl = x.transpose(1, 2).contiguous()
                variants["linear"] = lambda xl=xl, w2=w2, cv=cv: F.linear(xl, w2, cv.bias)
            if cv.out_channels == 1:
                w8 = torch.zeros(8, cv.in_channels, cv.kernel_size[0], device=dev, dtype=cv.weight.dtype)
                w8[:1] = cv.weight.detach()
                w8t = w8.transpose(1, 2).contiguous().transpose(1, 2)
                variants["cout 8, time-major"] = lambda xt=xt, w8t=w8t: F.conv1d(xt, w8t)
            row = dict(rows=rows, frames=n, conv=f"{cv.in_channels}->{cv.out_channels} k{cv.kernel_size[0]} "
                       f"d{cv.dilation[0]} s{cv.stride[0]} T{T}")  # fmt: skip
            for name, fn in variants.items():
                k = kernels_of(fn, dev)
                g = capture(lambda _x, fn=fn: fn(), (x,)) if dev.type == "cuda" else (lambda _x, fn=fn: fn())
                ms = time_ms(lambda g=g, x=x: g(x), blocks=3, reps=20)
                row[name] = dict(kernels=k, ms=ms)
                if name in ("now", "time-major"):
                    tot[name + " ms"] += ms
                    tot[name + " kernels"] += k
            res["layouts"].append(row)
            print(row)
        print(f"rows {rows} frames {n}: totals {dict(tot)}")
        res["layouts"].append(dict(rows=rows, frames=n, totals=dict(tot)))


RAGGED_PLAN = ([1, 1, 2, 4], [2, 4, 1, 0], [4, 8, 16, 2], [16, 3, 1, 8])  # per call: each response's frames


def ragged(c2w, dev, res) -> None:
    """The runner's ragged calls against each response alone (one runner each way, same weights)."""
    from types import SimpleNamespace

    from omni_rt.config import EngineSettings
    from omni_rt.pipeline.code2wav_runner import Code2WavRunner

    s = EngineSettings(max_sessions=4, code2wav_batch=True, cuda_graphs=dev.type == "cuda")
    model = SimpleNamespace(code2wav=c2w, device=dev)
    together, alone = Code2WavRunner(model, s), Code2WavRunner(model, s)
    reqs = [SimpleNamespace(slot=i) for i in range(4)]
    gen = torch.Generator().manual_seed(2)
    q, vocab = c2w.cfg.num_quantizers, c2w.cfg.codebook_size
    worst = 0.0
    for r in reqs:
        together.open(r)
        alone.open(r)
    for sizes in RAGGED_PLAN:
        on = [(r, n) for r, n in zip(reqs, sizes, strict=True) if n]
        frames = [torch.randint(0, vocab, (n, q), generator=gen).tolist() for _, n in on]
        got = together.push_many([r for r, _ in on], frames)
        for (r, _), f, g in zip(on, frames, got, strict=True):
            want = alone.push(r, f)
            assert len(g) == len(want), (len(g), len(want))
            worst = max(worst, float(abs(g - want).max()))
    res["ragged_max_diff"] = worst
    print(f"ragged calls {RAGGED_PLAN}: max |PCM difference| from each response alone {worst:.3e}")
    for rows, n in ((4, 4), (8, 16)):
        fn, _, _ = graphed_step(c2w, c2w.step, rows, n, dev)
        full = time_ms(fn)
        fn, _, _ = graphed_step(c2w, c2w.step, rows, n, dev, valid=[n, 1] * (rows // 2))
        ms = time_ms(fn)
        res.setdefault("ragged_ms", []).append(dict(rows=rows, frames=n, full_ms=full, ragged_ms=ms))
        print(f"graphed step rows {rows} frames {n}: every row full {full:.3f} ms, ragged {ms:.3f} ms")


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b")
    ap.add_argument("--out", default="gpu_code2wav.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--dynamic", action="store_true", help="compile once for every shape")
    ap.add_argument("--layouts", action="store_true")
    ap.add_argument("--skip-graphed", action="store_true")
    ap.add_argument("--ragged", action="store_true")
    ap.add_argument("--variants", default="snake,rmsnorm;snake,rmsnorm,code2wav",
                    help="fused kernel sets, ';' between sets")  # fmt: skip
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--frames", default="1,2,4,8,16")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = preset(args.preset).code2wav
    c2w = Code2Wav(cfg).to(dev, dtype).eval().requires_grad_(False)
    init_random(c2w, seed=0)
    res: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                 "torch": torch.__version__, "graphed": [], "profile": [], "compiled": []}  # fmt: skip
    rows_list = [int(x) for x in args.rows.split(",")]
    frames_list = [int(x) for x in args.frames.split(",")]
    variants = [v.split(",") for v in args.variants.split(";")] if dev.type == "cuda" else [[]]
    first_wav = None
    for names in [] if args.skip_graphed else variants:
        from omni_rt.kernels import fused

        fused.uninstall_all(c2w)
        if names:
            fused.install_all(c2w, enabled=set(names))
        label = "+".join(names) or "plain"
        wav = stream_pcm(c2w, dev)
        diff = 0.0 if first_wav is None else float((wav.float() - first_wav.float()).abs().max())
        first_wav = wav if first_wav is None else first_wav
        print(f"\n[{label}] a 2-row stream of chunks {STREAM_CHUNKS} (restarted at the 5th), graphed: max "
              f"difference from the first variant {diff:.3e} (peak {float(wav.abs().max()):.3f})")  # fmt: skip
        res.setdefault("diff", {})[label] = diff
        for rows in rows_list:
            for n in frames_list:
                fn, _, _ = graphed_step(c2w, c2w.step, rows, n, dev)
                ms = time_ms(fn)
                res["graphed"].append(dict(variant=label, rows=rows, frames=n, ms=ms))
                print(
                    f"[{label}] graphed rows {rows:2} frames {n:2}: {ms:7.3f} ms  ({ms / (rows * n):.3f} ms/frame)"
                )
        for rows, n in ((1, 1), (1, 16), (8, 16)):
            p = profile_step(c2w, rows, n, dev)
            p["variant"] = label
            res["profile"].append(p)
            print(
                f"[{label}] profile rows {rows} frames {n}: {p['kernels']} kernels, {p['kernel_ms']:.3f} ms"
            )
            for t in p["top"][:8]:
                print(f"  {t['count']:4} x {t['ms']:7.3f} ms  {t['name']}")
    if args.ragged:
        from omni_rt.kernels import fused

        fused.uninstall_all(c2w)
        if dev.type == "cuda":
            fused.install_all(c2w, enabled={"snake", "rmsnorm", "code2wav"})
        ragged(c2w, dev, res)
    if args.layouts:
        layouts(c2w, dev, res)
    if args.compile:
        plain = Code2Wav(cfg).to(dev, dtype).eval().requires_grad_(False)  # Inductor cannot trace our kernels
        init_random(plain, seed=0)
        cstep = torch.compile(plain.step, dynamic=args.dynamic)
        for rows, n in ((1, 1), (1, 4), (1, 16), (8, 1), (8, 16)):
            try:
                st_e, st_c = c2w.new_state(rows), c2w.new_state(rows)
                codes = torch.randint(0, cfg.codebook_size, (rows, cfg.num_quantizers, n), device=dev)
                t0 = time.perf_counter()
                got = cstep(codes, st_c).clone()
                comp_s = time.perf_counter() - t0
                ref = plain.step(codes, st_e)
                diff = float((got.float() - ref.float()).abs().max())
                fn, _, _ = graphed_step(plain, cstep, rows, n, dev)
                ms = time_ms(fn)
                res["compiled"].append(dict(rows=rows, frames=n, compile_s=comp_s, ms=ms, max_diff=diff))
                print(
                    f"compiled rows {rows} frames {n}: compile {comp_s:.1f} s, graphed {ms:.3f} ms, diff {diff:.2e}"
                )
            except Exception as e:  # noqa: BLE001 - report and go on
                res["compiled"].append(dict(rows=rows, frames=n, error=repr(e)[:300]))
                print(f"compiled rows {rows} frames {n}: FAILED {e!r}"[:400])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("\n| variant | rows | " + " | ".join(f"{n} fr" for n in frames_list) + " |")
    for label in dict.fromkeys(r["variant"] for r in res["graphed"]):
        for rows in rows_list:
            cells = [f"{r['ms']:.2f}" for r in res["graphed"] if r["rows"] == rows and r["variant"] == label]
            print(f"| {label} | {rows} | " + " | ".join(cells) + " |")
    for p in res["profile"]:
        print(
            f"| {p['variant']} | kernels at ({p['rows']}, {p['frames']}) | {p['kernels']} | {p['kernel_ms']:.3f} ms |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
