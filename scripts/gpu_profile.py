"""Where a decode step's time goes at real shapes: kernels per step, GPU busy time, top kernels.

    PYTHONUNBUFFERED=1 python scripts/gpu_profile.py --out $OUT/gpu_profile.json

Profiles (torch.profiler, CUDA activity) 5 eager calls each of: one Thinker decode step (batch 1, MoE
through the Triton kernel and through grouped_mm), one Talker step, and one code-predictor frame, then the same with the fused kernels
(`kernels/fused.py`) on top of the Triton MoE kernel; the 57-token Thinker prefill plain, with the
fused row-wise kernels, and with the Triton MoE prefill kernel too. For
each: kernel launches per call, summed kernel time per call (the GPU-busy time a CUDA graph could at
best reach, launch gaps removed), and the kernels with the most total time. With the graphed times from
`scripts/gpu_stages.py` this says whether a step is launch-bound (graph ≈ kernel sum, many tiny kernels)
or bound by slow kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_rt.bench import chat_prompt  # noqa: E402
from omni_rt.model.config import preset  # noqa: E402
from omni_rt.model.omni import OmniModel  # noqa: E402

try:
    from omni_rt.kernels import moe_decode as md
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
    import moe_decode as md  # type: ignore[no-redef]

CALLS = 5


def prof(name: str, fn, res: dict) -> None:
    try:
        _prof(name, fn, res)
    except Exception as exc:  # noqa: BLE001 - one failing profile must not hide the others
        print(f"{name}: FAILED {exc!r}", flush=True)
        res[name] = dict(error=repr(exc))


def _prof(name: str, fn, res: dict) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for ev in p.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name].append(ev.time_range.elapsed_us())
    n = sum(len(v) for v in per_kernel.values()) / CALLS
    busy_us = sum(sum(v) for v in per_kernel.values()) / CALLS
    top = sorted(((sum(v) / CALLS, len(v) / CALLS, k) for k, v in per_kernel.items()), reverse=True)[:16]
    res[name] = dict(
        kernels_per_call=n,
        kernel_us_per_call=busy_us,
        top=[dict(us_per_call=t, launches_per_call=c, kernel=k[:120]) for t, c, k in top],
    )
    print(f"\n{name}: {n:.0f} kernels per call, {busy_us / 1e3:.2f} ms of kernel time per call", flush=True)
    for t, c, k in top:
        print(f"  {t:9.1f} us  {c:6.0f}x  {k[:100]}", flush=True)


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b")
    ap.add_argument("--out", default="gpu_profile.json")
    args = ap.parse_args(argv)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    cfg = preset(args.preset)
    model = OmniModel.build(cfg, device=dev, dtype=dtype, weights="random", seed=0)
    th, tk = model.thinker, model.talker
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    slots = torch.zeros(1, dtype=torch.long, device=dev)
    tcache = th.allocate_cache(1, 512)
    prompt = torch.tensor([chat_prompt(20, 24)], device=dev)
    T = prompt.shape[1]
    th(prompt, torch.arange(T, device=dev)[None], tcache, slots, last_only=True)
    ids, pos = torch.tensor([[1000]], device=dev), torch.tensor([[T]], device=dev)

    def thinker_step():
        return th(ids, pos, tcache, slots)[0][:, -1].argmax(-1)

    kcache = tk.allocate_cache(1, 512)
    x = torch.randn(1, 1, cfg.talker.hidden_size, device=dev, dtype=dtype) * 0.02
    kpos = torch.tensor([[40]], device=dev)

    def talker_step():
        logits, h = tk(x, kpos, kcache, slots)
        return logits[:, -1].argmax(-1)

    tk.code_predictor.setup_cache(1, dev, dtype)
    hid = torch.randn(1, cfg.talker.hidden_size, device=dev, dtype=dtype)
    code0 = torch.tensor([5], device=dev)

    prof("thinker decode step [grouped_mm]", thinker_step, res)
    prof("talker step [grouped_mm]", talker_step, res)
    prof("code predictor frame", lambda: tk.predict_frame(hid, code0), res)

    def thinker_prefill():
        return th(prompt, torch.arange(T, device=dev)[None], tcache, slots, last_only=True)[0]

    prof("thinker prefill, 57 tokens [grouped_mm]", thinker_prefill, res)
    md.install(model, "triton")
    prof("thinker decode step [triton]", thinker_step, res)
    prof("talker step [triton]", talker_step, res)
    from omni_rt.kernels import fused

    fused.install_all(model)
    prof("thinker decode step [triton + fused]", thinker_step, res)
    prof("talker step [triton + fused]", talker_step, res)
    prof("code predictor frame [fused]", lambda: tk.predict_frame(hid, code0), res)
    prof("thinker prefill, 57 tokens [grouped_mm + fused]", thinker_prefill, res)
    md.install(model, "triton", prefill_kernel=True)
    prof("thinker prefill, 57 tokens [triton prefill + fused]", thinker_prefill, res)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
