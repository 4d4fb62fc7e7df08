"""Which engine settings each `omni-rt bench` run measures: the protocol's rows (every optimisation off,
then each added in turn, all on), the rows a run selects, `--set` overrides, `--load-variants` and
`--row-variants`."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["parse_sets", "parse_variants", "row_plan", "row_variants"]


def row_plan(device: str, kernel_ok: bool) -> list[tuple[str, dict[str, Any]]]:
    """Cumulative settings: every optimisation off, then each one added in turn; the last is all on.

    The switches come from `EngineSettings`: every field where the defaults differ from `all_off()`
    is one step (known ones in a meaningful order, any newer ones after them), so a new optimisation
    setting gets its own row without touching the benchmark.
    """
    from omni_rt.config import EngineSettings

    on, off = EngineSettings().model_dump(), EngineSettings.all_off().model_dump()
    differ = {k for k in on if on[k] != off[k]}
    known: list[tuple[str, tuple[str, ...]]] = [
        ("+ cuda graphs", ("cuda_graphs",)),
        ("+ prefill graphs", ("prefill_graphs",)),
        ("+ triton MoE decode", ("moe_backend",)),
        ("+ triton MoE prefill", ("moe_prefill_kernel",)),
        ("+ fused kernels", ("fused_kernels",)),
        ("+ packed projections", ("packed_projections",)),
        ("+ event hand-off", ("handoff",)),
        ("+ talker prefill overlap", ("talker_overlap_prefill",)),
        ("+ frame 0 in prefill, frames in step", ("frame0_in_prefill", "frames_in_step")),
        ("+ 1-frame first chunk", ("first_chunk_frames", "chunk_growth", "max_chunk_frames")),
        ("+ yield to talker", ("yield_to_talker_ms",)),
        ("+ yield until first audio", ("yield_until",)),
        ("+ pinned read-backs", ("pinned_readback",)),
        ("+ early start", ("early_start",)),
        ("+ programmatic frames while the Thinker is idle", ("programmatic_launch",)),
    ]
    # what does nothing on a CPU (off there by default, or no effect off the GPU): no row there
    gpu_only = {
        ("cuda_graphs",), ("prefill_graphs",), ("packed_projections",), ("pinned_readback",), ("early_start",),
        ("programmatic_launch",),
    }  # fmt: skip
    # Triton kernels: a row only where they run
    needs_kernels = {("moe_backend",), ("moe_prefill_kernel",), ("fused_kernels",)}
    covered = {f for _, fields in known for f in fields}
    steps: list[tuple[str, dict[str, Any]]] = []
    for name, fields in known:
        change = {f: on[f] for f in fields if f in differ}
        if fields in needs_kernels and not kernel_ok:
            continue
        if change and not (device == "cpu" and fields in gpu_only):
            steps.append((name, change))
    steps += [(f"+ {f.replace('_', ' ')}", {f: on[f]}) for f in sorted(differ - covered)]
    plan, acc = [("all off", {})], {}
    for name, change in steps:
        acc = acc | change
        plan.append((name, dict(acc)))
    plan[-1] = (plan[-1][0] + " (all on)", plan[-1][1])
    return plan


def _settings(base: dict[str, Any], overrides: dict[str, Any]) -> Any:
    from omni_rt.config import EngineSettings

    return EngineSettings.all_off(**(base | overrides))


def parse_sets(items: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` pairs as engine-setting overrides (`config.setting_overrides`); a malformed pair
    or a name that is no setting ends the run with its message."""
    from omni_rt.config import setting_overrides

    try:
        return setting_overrides(items)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def parse_variants(
    raw: str | None, flag: str = "--load-variants", default: tuple[str, ...] = ("served",)
) -> dict[str, dict[str, Any]]:
    """`--load-variants '{"name": {"setting": value, ...}, ...}'`: the load protocol once per variant, each
    over all on and --set (without one: the `default` names with nothing more, "served");
    `--row-variants` the same for rows beside the all-on row (without one: none)."""
    from omni_rt.config import EngineSettings

    if not raw:
        return {name: {} for name in default}
    try:
        variants = json.loads(raw)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{flag}: not JSON ({e})") from None
    ok = isinstance(variants, dict) and variants and all(isinstance(v, dict) for v in variants.values())
    if not ok:
        raise SystemExit(f'{flag}: give {{"name": {{"setting": value, ...}}, ...}}')
    for name, overrides in variants.items():
        unknown = set(overrides) - set(EngineSettings.model_fields)
        if unknown:
            raise SystemExit(f"{flag} {name!r}: no such engine setting {sorted(unknown)}")
    return variants


def _select_rows(args: argparse.Namespace, plan: list[tuple[str, dict[str, Any]]]) -> list:
    """The protocol rows this run asks for: all by default, none with --load alone."""
    alone = args.load or getattr(args, "speech_turn", False)  # another protocol asked for alone
    spec = args.rows if args.rows is not None else ("none" if alone else "all")
    if spec == "all":
        return plan
    # negative indices count from the end: -1 is all on, whatever rows this version of the plan has
    keep = [_row_index(i, len(plan)) for i in spec.split(",") if i and i != "none"]
    if None in keep:
        names = ", ".join(f"{i}: {n}" for i, (n, _) in enumerate(plan))
        raise SystemExit(f"--rows {spec}: this run's rows are {names}")
    return [p for i, p in enumerate(plan) if i in keep]


def row_variants(args: argparse.Namespace, full_plan: list, selected: list) -> list:
    """`--row-variants`: rows of all on plus each variant's settings, timed as the all-on row and with
    its concurrency rows (not its greedy pass), after the selected rows; none where no row is selected."""
    variants = parse_variants(getattr(args, "row_variants", None), "--row-variants", default=())
    if not selected:
        return []
    return [(f"all on + {name}", full_plan[-1][1] | overrides) for name, overrides in variants.items()]


def _row_index(text: str, rows: int) -> int | None:
    """A `--rows` entry as a row index (negative from the end), or None where it names no row."""
    try:
        i = int(text)
    except ValueError:
        return None
    return i % rows if -rows <= i < rows else None


def _greedy_name(name: str) -> str:
    return name.replace("(all on)", "(all on, greedy)") if name.endswith("(all on)") else f"{name} (greedy)"
