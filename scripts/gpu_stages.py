"""Per-stage step times at the real shapes, eager vs CUDA-graphed (`omni_rt.pipeline.graphs`), per MoE path.

    PYTHONUNBUFFERED=1 python scripts/gpu_stages.py --out $OUT/gpu_stages.json

Builds the `qwen3-omni-30b-a3b` preset with random bf16 weights on the GPU and times, batch 1:
- Thinker prefill of a 57-token prompt (eager) and one Thinker decode step (greedy next token);
- one Talker step (codec logits -> code 0) and the code predictor's 15 steps of a frame, and a whole
  Talker frame (Talker step + 15 predictor steps) in one graph;
- Code2Wav streaming `step` at chunk sizes 1, 2, 4 and 16 frames.
MoE paths: A1's "grouped_mm" (the `auto` choice on CUDA) and the Triton decode kernel (`install`).
Each graphed step is checked bit-equal to its eager run. Time: replays between CUDA events, median of 5
blocks of 20. The bytes floor of each step is its weights read once at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_rt.bench import chat_prompt  # noqa: E402
from omni_rt.model.config import preset  # noqa: E402
from omni_rt.model.omni import OmniModel  # noqa: E402
from omni_rt.model.talker import talker_prompt  # noqa: E402
from omni_rt.pipeline.graphs import capture  # noqa: E402

try:
    from omni_rt.kernels import moe_decode as md
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
    import moe_decode as md  # type: ignore[no-redef]

BW = 4.2e12


def time_fn(fn, *inputs, blocks=5, reps=20) -> float:
    """Median over `blocks` of the mean time of `reps` back-to-back calls, in ms (CUDA events)."""
    for _ in range(3):
        fn(*inputs)
    if not torch.cuda.is_available():  # --device cpu: checks the script's logic only
        t = time.perf_counter()
        fn(*inputs)
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    out = []
    for _ in range(blocks):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn(*inputs)
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) / reps)
    return statistics.median(out)


def same(a, b) -> bool:
    if isinstance(a, tuple | list):
        return all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(torch.equal(a, b))


def clone(x):
    return tuple(clone(t) for t in x) if isinstance(x, tuple | list) else x.clone()


def eager_vs_graph(name, fn, inputs, floor_ms, res, prep=None):
    try:
        return _eager_vs_graph(name, fn, inputs, floor_ms, res, prep)
    except Exception as exc:  # noqa: BLE001 - one failing step must not hide the others
        print(f"{name}: FAILED {exc!r}", flush=True)
        res["rows"].append(dict(step=name, error=repr(exc)))


def _eager_vs_graph(name, fn, inputs, floor_ms, res, prep=None):
    """Time fn eagerly and captured; check the graph's output equals the eager output bit for bit.

    prep(): resets state a step mutates (e.g. Code2Wav's stream position) before each compared run.
    """
    if prep:
        prep()
    ref = clone(fn(*inputs))
    eager = time_fn(fn, *inputs)
    g = capture(fn, inputs)
    if prep:
        prep()
    got = clone(g(*inputs))
    graphed = time_fn(g, *inputs)
    row = dict(
        step=name, eager_ms=eager, graphed_ms=graphed, floor_ms=floor_ms, graph_equals_eager=same(ref, got)
    )
    res["rows"].append(row)
    print(
        f"{name:38} eager {eager:8.3f} ms  graphed {graphed:8.3f} ms  floor {floor_ms:6.3f} ms  "
        f"equal {row['graph_equals_eager']}",
        flush=True,
    )
    return g


def nbytes(mod) -> int:
    return sum(p.numel() * p.element_size() for p in mod.parameters())


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-omni-30b-a3b")
    ap.add_argument("--out", default="gpu_stages.json")
    ap.add_argument("--device", default="cuda", help="cpu with --preset tiny checks the script's logic")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = preset(args.preset)
    res: dict = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": [],
    }
    t0 = time.perf_counter()
    model = OmniModel.build(cfg, device=dev, dtype=dtype, weights="random", seed=0)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    res["build_s"] = time.perf_counter() - t0
    print(f"build {res['build_s']:.1f} s", flush=True)
    th, tk, c2w = model.thinker, model.talker, model.code2wav
    tc, kc = cfg.thinker, cfg.talker

    # bytes floors (weights read once per step, batch 1)
    def moe_active(c, k_shared=0):
        attn = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        attn += c.num_attention_heads * c.head_dim * c.hidden_size
        experts = c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size
        shared = 3 * c.hidden_size * k_shared + c.hidden_size if k_shared else 0
        return c.num_hidden_layers * (attn + experts + shared + c.hidden_size * c.num_experts) * 2

    thinker_floor = (moe_active(tc) + tc.hidden_size * tc.vocab_size * 2) / BW * 1e3
    talker_floor = (
        (moe_active(kc, kc.shared_expert_intermediate_size) + kc.hidden_size * kc.vocab_size * 2) / BW * 1e3
    )
    cp_bytes = nbytes(tk.code_predictor.model.layers) + nbytes(tk.code_predictor.lm_head) / 15
    cp_floor = 15 * cp_bytes / BW * 1e3
    res["floors_ms"] = dict(
        thinker_step=thinker_floor, talker_step=talker_floor, code_predictor_frame=cp_floor
    )

    slots = torch.zeros(1, dtype=torch.long, device=dev)
    tcache = th.allocate_cache(1, 512)
    prompt = torch.tensor([chat_prompt(20, 24)], device=dev)  # [1, 57]
    T = prompt.shape[1]
    pos = torch.arange(T, device=dev)[None]

    def prefill(ids, p):
        return th(ids, p, tcache, slots, last_only=True)[0][:, -1].argmax(-1)

    ms = time_fn(prefill, prompt, pos, blocks=3, reps=5)
    res["rows"].append(dict(step="thinker prefill 57 (eager, grouped_mm)", eager_ms=ms))
    print(f"thinker prefill 57 tokens eager {ms:.2f} ms", flush=True)

    def thinker_step(ids, p):
        logits, _ = th(ids, p, tcache, slots)
        return logits[:, -1].argmax(-1)  # [1]

    step_ids = torch.tensor([[1000]], device=dev)
    step_pos = torch.tensor([[T]], device=dev)

    # Talker inputs
    kcache = tk.allocate_cache(1, 512)
    tp = talker_prompt(tk, th.embed, prompt[0].tolist(), cfg.speaker_id("ethan"), 1000)  # [L, Ht]
    L = tp.shape[0]
    tk(tp[None], torch.arange(L, device=dev)[None], kcache, slots)
    tk_in = torch.randn(1, 1, kc.hidden_size, device=dev, dtype=dtype) * 0.02
    tk_pos = torch.tensor([[L]], device=dev)

    def talker_step(x, p):
        logits, h = tk(x, p, kcache, slots)
        return logits[:, -1].argmax(-1), h[:, -1]  # [1], [1, Ht]

    tk.code_predictor.setup_cache(1, dev, dtype)
    hid = torch.randn(1, kc.hidden_size, device=dev, dtype=dtype)
    code0 = torch.tensor([5], device=dev)

    def cp_frame(h, c0):
        return tk.predict_frame(h, c0)  # [1, 16]

    def talker_frame(x, p):
        c0, h = talker_step(x, p)
        return tk.predict_frame(h, c0)

    backends = ("grouped_mm", "triton") if dev.type == "cuda" else ("grouped_mm",)
    for backend in backends:
        if backend == "triton":
            n = md.install(model, "triton")
            print(f"installed the Triton MoE decode kernel in {n} blocks", flush=True)
        eager_vs_graph(
            f"thinker decode step [{backend}]", thinker_step, (step_ids, step_pos), thinker_floor, res
        )
        eager_vs_graph(f"talker step [{backend}]", talker_step, (tk_in, tk_pos), talker_floor, res)
        eager_vs_graph(
            f"talker frame: step + 15 codes [{backend}]",
            talker_frame,
            (tk_in, tk_pos),
            talker_floor + cp_floor,
            res,
        )
    eager_vs_graph("code predictor frame (15 steps)", cp_frame, (hid, code0), cp_floor, res)

    c2w_floor = nbytes(c2w) / BW * 1e3
    for n in (1, 2, 4, 16):
        state = c2w.new_state(1)
        codes = torch.randint(0, cfg.code2wav.codebook_size, (1, cfg.code2wav.num_quantizers, n), device=dev)

        def c2w_step(c, _state=state):
            return c2w.step(c, _state)

        def reset(_state=state):  # a fresh stream: every state tensor back to its initial value
            _state.pos.zero_()
            _state.k.zero_()
            _state.v.zero_()
            _state.key_pos.fill_(-1)
            for t in _state.conv.values():
                t.zero_()

        eager_vs_graph(f"code2wav step, {n}-frame chunk", c2w_step, (codes,), c2w_floor, res, prep=reset)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print()
    print(f"{'step':42} {'eager ms':>9} {'graphed ms':>10} {'floor ms':>8} {'x floor':>7} eq")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['step']:42} FAILED")
            continue
        if "graphed_ms" not in r:
            print(f"{r['step']:42} {r['eager_ms']:9.3f}")
            continue
        print(
            f"{r['step']:42} {r['eager_ms']:9.3f} {r['graphed_ms']:10.3f} {r['floor_ms']:8.3f} "
            f"{r['graphed_ms'] / r['floor_ms']:7.1f} {r['graph_equals_eager']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
