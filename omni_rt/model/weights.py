"""Weight loading from Hugging Face checkpoints, and seeded random weights at any shape.

    load_weights(model, source, device=None, dtype=None, strict=True) -> LoadReport
    init_random(model, seed=0, std=0.02, device=None, dtype=None) -> None
    materialize_(model, device, dtype) -> None      # meta parameters -> empty tensors on `device`

`source` is a checkpoint directory (`model.safetensors`, or sharded `model-0000x-of-0000y.safetensors`
with `model.safetensors.index.json`) or a mapping name -> tensor. Names are the checkpoint's; the model's
parameter names equal them except packed experts (docs/internals.md):

    checkpoint (published, and what transformers 5.17's save_pretrained writes)   model parameter
    {p}.mlp.experts.{e}.gate_proj.weight  [I, H]       ->  {p}.mlp.experts.gate_up_proj[e, :I]   [E, 2I, H]
    {p}.mlp.experts.{e}.up_proj.weight    [I, H]       ->  {p}.mlp.experts.gate_up_proj[e, I:]
    {p}.mlp.experts.{e}.down_proj.weight  [H, I]       ->  {p}.mlp.experts.down_proj[e]          [E, H, I]

transformers 5.17 holds experts packed in memory but `save_pretrained` converts them back to these
per-expert names, so a saved test checkpoint has the published layout. Already-packed names
(`{p}.mlp.experts.gate_up_proj`) are accepted as well. Tensors of the vision encoder, which omni_rt does
not implement (`SKIPPED_PREFIXES`), are skipped by name and counted in the report.

Loading is validated first (names and shapes from the safetensors headers, nothing read), so a bad
checkpoint raises one `WeightError` listing every unknown, mis-shaped and missing tensor before any
weight is written. Then shards are read one at a time, tensor by tensor, each copied straight into its
parameter on the target device and dtype: host memory holds one tensor of the checkpoint at a time.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from omni_rt.errors import ConfigError, WeightError
from omni_rt.model.audio_encoder import CHECKPOINT_PREFIX as AUDIO_ENCODER_PREFIX

# Checkpoint tensors of parts omni_rt deliberately does not implement: skipped, never "unknown". The vision
# encoder: omni_rt answers text and speech; image and video input is out of its scope.
SKIPPED_PREFIXES = ("thinker.visual.",)

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_MAX_LISTED = 12
RESIDUAL_CONV_GAIN = 0.1  # init_random: output conv of Code2Wav residual units
# init_random: input embeddings. At 0.02 the token's identity is drowned by the 48 layers' outputs and a
# real-shape Thinker greedily repeats one token forever (measured on an H200); unit-RMS rows keep it.
EMBED_STD = 1.0  # names listed per error group; the rest are counted


@dataclass
class LoadReport:
    loaded: int = 0  # checkpoint tensors copied into the model
    skipped: list[str] = field(default_factory=list)  # under SKIPPED_PREFIXES
    unknown: list[str] = field(default_factory=list)  # only when strict=False
    missing: list[str] = field(default_factory=list)  # only when strict=False


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: `param[index]` (index None: the whole parameter)."""

    param: str
    index: tuple | None
    shape: tuple[int, ...]  # the shape the checkpoint tensor must have
    part: object  # coverage key: which part of `param` this fills


# ---------------------------------------------------------------------------------------------------------
# Sources: (name, shape, reader) without reading tensor data


class _Source:
    """A checkpoint's tensor names and shapes, and a way to read them shard by shard."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], groups: list[tuple[Callable, list[str]]]):
        self.shapes = shapes
        self.groups = groups  # [(open_group() -> context manager with get(name), names)]


def _dir_source(path: Path) -> _Source:
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightError(f"{index}: not a safetensors index ({e})") from None
        by_file: dict[str, list[str]] = defaultdict(list)
        for name, fname in weight_map.items():
            by_file[fname].append(name)
        absent = sorted(f for f in by_file if not (path / f).is_file())
        if absent:
            raise WeightError(f"{index} names shard files that do not exist in {path}: {absent}")
    elif single.is_file():
        by_file = {single.name: []}  # names read from the header below
    else:
        raise WeightError(f"no model.safetensors or model.safetensors.index.json in {path}")

    shapes: dict[str, tuple[int, ...]] = {}
    groups = []
    for fname, names in by_file.items():
        f = path / fname
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                present = set(h.keys())
                if not names:
                    names = sorted(present)
                lost = [n for n in names if n not in present]
                if lost:
                    raise WeightError(f"{f.name} lacks tensors its index assigns to it: {_listed(lost)}")
                for n in names:
                    shapes[n] = tuple(h.get_slice(n).get_shape())
        except WeightError:
            raise
        except Exception as e:  # a truncated or foreign file: name it
            raise WeightError(f"cannot read safetensors file {f}: {e}") from e
        groups.append((lambda f=f: _SafeReader(f), names))
    return _Source(shapes, groups)


class _SafeReader:
    def __init__(self, f: Path):
        from safetensors import safe_open

        self._cm = safe_open(str(f), framework="pt", device="cpu")

    def __enter__(self):
        self._h = self._cm.__enter__()
        return self

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    def get(self, name: str) -> torch.Tensor:
        return self._h.get_tensor(name)


class _MapReader:
    def __init__(self, m: Mapping[str, torch.Tensor]):
        self._m = m

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def get(self, name: str) -> torch.Tensor:
        return self._m[name]


def _open_source(source: str | Path | Mapping[str, torch.Tensor]) -> _Source:
    if isinstance(source, Mapping):
        bad = [k for k, v in source.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise WeightError(f"mapping values must be tensors; not for: {_listed(bad)}")
        shapes = {k: tuple(v.shape) for k, v in source.items()}
        return _Source(shapes, [(lambda: _MapReader(source), list(source))])
    path = Path(source)
    if not path.is_dir():
        raise WeightError(f"checkpoint directory {path} does not exist")
    return _dir_source(path)


# ---------------------------------------------------------------------------------------------------------
# Name map


def _target(name: str, params: dict[str, nn.Parameter]) -> _Target | None:
    """The parameter (slice) a checkpoint tensor fills, or None if the model has no such tensor."""
    if name in params:
        return _Target(name, None, tuple(params[name].shape), "all")
    m = _EXPERT.match(name)
    if m is None:
        return None
    prefix, e, proj = m["prefix"], int(m["e"]), m["proj"]
    if proj == "down_proj":
        p = params.get(f"{prefix}.down_proj")
        if p is None or p.dim() != 3 or e >= p.shape[0]:
            return None
        return _Target(f"{prefix}.down_proj", (e,), tuple(p.shape[1:]), (e, "down"))
    p = params.get(f"{prefix}.gate_up_proj")
    if p is None or p.dim() != 3 or e >= p.shape[0]:
        return None
    inter = p.shape[1] // 2
    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)  # gate rows first, then up
    return _Target(f"{prefix}.gate_up_proj", (e, rows), (inter, p.shape[2]), (e, proj))


def _parts_needed(name: str, p: torch.Tensor) -> set:
    """Coverage keys that together fill parameter `name` (per-expert parts or the whole)."""
    if name.endswith(".experts.gate_up_proj") and p.dim() == 3:
        return {(e, k) for e in range(p.shape[0]) for k in ("gate_proj", "up_proj")}
    if name.endswith(".experts.down_proj") and p.dim() == 3:
        return {(e, "down") for e in range(p.shape[0])}
    return {"all"}


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", … ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


def _group_missing(missing: list[str], params: dict[str, nn.Parameter]) -> str:
    """Missing parameters grouped by stage, then by name pattern (layer numbers folded to `*`)."""
    by_stage: dict[str, list[str]] = defaultdict(list)
    for n in missing:
        by_stage[n.split(".", 1)[0]].append(n)
    lines = []
    for stage, names in sorted(by_stage.items()):
        total = sum(1 for n in params if n.split(".", 1)[0] == stage)
        if len(names) == total:
            lines.append(f"  {stage}.*: all {total} tensors missing (the checkpoint has no {stage})")
            continue
        patterns: dict[str, int] = defaultdict(int)
        for n in names:
            patterns[re.sub(r"\.\d+\.", ".*.", n)] += 1
        shown = [f"{p} (x{c})" if c > 1 else p for p, c in sorted(patterns.items())]
        lines.append(f"  {stage}: {len(names)} of {total} tensors missing: {_listed(shown)}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Materialising meta parameters


def _resolve(model: nn.Module, device, dtype) -> tuple[torch.device, torch.dtype]:
    p = next(iter(model.parameters()), None)
    cur_dev = p.device if p is not None else torch.device("cpu")
    dev = (
        torch.device(device)
        if device is not None
        else (cur_dev if cur_dev.type != "meta" else torch.device("cpu"))
    )
    dt = dtype if dtype is not None else (p.dtype if p is not None else torch.float32)
    if isinstance(dt, str):
        resolved = getattr(torch, dt, None)
        if not isinstance(resolved, torch.dtype):
            raise ConfigError(f"unknown dtype {dt!r}")
        dt = resolved
    return dev, dt


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    # Replaces the parameter in its owning module only: tied parameters would come untied (none are:
    # Qwen3-Omni's lm_head is not tied to its embeddings).
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)


@torch.no_grad()
def materialize_(model: nn.Module, device, dtype: torch.dtype) -> None:
    """Give every parameter that is on the meta device, or on another device/dtype, fresh storage.

    One parameter at a time: meta parameters get uninitialised storage allocated directly on `device`
    in `dtype` (the caller fills it); real ones are converted, keeping their values. Buffers move to
    `device` keeping their dtype (tables such as rotary frequencies stay fp32).
    """
    device = torch.device(device)
    for name, p in list(model.named_parameters()):
        if p.device.type == "meta":
            _set_param(model, name, torch.empty(p.shape, device=device, dtype=dtype))
        elif not _same_device(p.device, device) or p.dtype != dtype:
            _set_param(model, name, p.detach().to(device=device, dtype=dtype))
    for mod in model.modules():
        for k, b in mod._buffers.items():
            if b is not None and not _same_device(b.device, device):
                if b.device.type == "meta":
                    raise WeightError(
                        f"buffer {k} of {type(mod).__name__} is on the meta device; build with "
                        "OmniModel.build, which keeps buffers real"
                    )
                mod._buffers[k] = b.to(device)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


# ---------------------------------------------------------------------------------------------------------
# Loading


@torch.no_grad()
def load_weights(
    model: nn.Module,
    source: str | Path | Mapping[str, torch.Tensor],
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    strict: bool = True,
) -> LoadReport:
    """Load `source` into `model` (names as in the module docstring); parameters end on device/dtype.

    strict=True: any unknown or missing tensor is a `WeightError`. strict=False: they are returned in
    the report instead (missing parameters keep their current values: uninitialised memory when the
    model was built on meta). A mis-shaped tensor is always an
    error. Errors are raised before anything is written.
    """
    dev, dt = _resolve(model, device, dtype)
    src = _open_source(source)
    params = dict(model.named_parameters())
    report = LoadReport()

    plan: dict[str, _Target] = {}
    unknown, misshaped = [], []
    covered: dict[str, set] = defaultdict(set)
    for name, shape in src.shapes.items():
        if name.startswith(SKIPPED_PREFIXES):
            report.skipped.append(name)
            continue
        t = _target(name, params)
        if t is None:
            unknown.append(name)
            continue
        if shape != t.shape:
            misshaped.append(f"{name}: expected {list(t.shape)} for {t.param}, got {list(shape)}")
            continue
        plan[name] = t
        covered[t.param].add(t.part)
    missing = [
        n for n, p in params.items() if "all" not in covered[n] and not _parts_needed(n, p) <= covered[n]
    ]

    problems = []
    if misshaped:
        problems.append(f"{len(misshaped)} mis-shaped tensor(s):\n  " + "\n  ".join(misshaped[:_MAX_LISTED]))
    if strict and unknown:
        problems.append(f"{len(unknown)} unknown tensor(s) (no such parameter): {_listed(sorted(unknown))}")
    if strict and missing:
        problems.append(
            f"{len(missing)} parameter(s) missing from the checkpoint:\n" + _group_missing(missing, params)
        )
    if problems:
        where = "mapping" if isinstance(source, Mapping) else str(source)
        raise WeightError(f"cannot load weights from {where}:\n" + "\n".join(problems))
    report.unknown, report.missing = sorted(unknown), missing

    materialize_(model, dev, dt)
    params = dict(model.named_parameters())
    for open_group, names in src.groups:
        with open_group() as reader:
            for name in names:
                t = plan.get(name)
                if t is None:
                    continue
                dst = params[t.param].data
                if t.index is not None:
                    dst = dst[t.index]
                dst.copy_(reader.get(name))  # one checkpoint tensor in host memory at a time
                report.loaded += 1
    return report


# ---------------------------------------------------------------------------------------------------------
# Random weights


def _layers_per_decoder(names: Iterator[str]) -> dict[str, int]:
    """`{decoder prefix: number of layers}` from names like `thinker.model.layers.47.…`."""
    count: dict[str, int] = defaultdict(int)
    for n in names:
        m = re.match(r"^(.*\.layers)\.(\d+)\.", n)
        if m:
            count[m[1]] = max(count[m[1]], int(m[2]) + 1)
    return count


def _fill_rule(name: str, p: torch.Tensor, std: float, layers: dict[str, int]) -> tuple[str, float]:
    """("const", value) or ("normal", std) for one parameter; see `init_random`."""
    leaf = name.rsplit(".", 1)[-1]
    if p.dim() == 1:
        if name.endswith(("norm.weight", "ln_post.weight")):  # RMSNorm / LayerNorm gains
            return "const", 1.0
        if leaf in ("bias", "alpha", "beta"):  # SnakeBeta alpha/beta are log-scale: exp(0) = 1
            return "const", 0.0
        if leaf in ("gamma", "scale"):  # ConvNeXt gamma, Code2Wav layer scale: small residual branches
            return "const", 0.1
        return "normal", std
    if p.dim() >= 3 and not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        std_conv = 1.0 / math.sqrt(math.prod(p.shape[1:]))  # conv kernel (1-D or 2-D): fan-in keeps the scale
        if name.endswith("conv2.conv.weight"):
            std_conv *= RESIDUAL_CONV_GAIN  # Code2Wav residual units: x + conv2(...) would grow per unit
        return "normal", std_conv
    if name.startswith(AUDIO_ENCODER_PREFIX):
        # Fan-in for the audio encoder's matrices too: its tokens then come out O(1), like the Thinker's
        # EMBED_STD text embeddings they sit among. At N(0, std) every layer would shrink the signal
        # (~100x at small widths) and the audio would drown in the encoder's positional table.
        return "normal", 1.0 / math.sqrt(p.shape[1])
    if re.search(r"(embed_tokens|codec_embedding(\.\d+)?|code_embedding)\.weight$", name):
        return "normal", EMBED_STD
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        m = re.match(r"^(.*\.layers)\.\d+\.", name)
        n_layers = layers.get(m[1], 1) if m else 1
        return "normal", std / math.sqrt(2 * n_layers)  # residual outputs: stream grows O(1) over depth
    return "normal", std


@torch.no_grad()
def init_random(
    model: nn.Module,
    seed: int = 0,
    std: float = 0.02,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> None:
    """Seeded random weights, generated on the target device in the target dtype (meta params allowed).

    Rules, by checkpoint name:
    - norm weights (RMSNorm; LayerNorm incl. the audio encoder's `ln_post`) 1; biases and SnakeBeta
      alpha/beta 0; ConvNeXt gamma and layer scales 0.1;
    - input embeddings N(0, EMBED_STD = 1); projections N(0, std); residual-branch outputs (o_proj,
      down_proj, experts' down_proj) N(0, std/sqrt(2·layers)), so the residual stream stays O(1) through
      48 layers;
    - conv kernels (Code2Wav's 1-D, the audio encoder's 2-D) N(0, 1/sqrt(fan_in)); the output conv of
      Code2Wav's residual units 10x smaller, so the waveform keeps a std of ~0.1 instead of growing
      through the 12 residual units into the [-1, 1] clamp;
    - the audio encoder's matrices N(0, 1/sqrt(fan_in)) too (see `_fill_rule`).
    Each tensor's stream is seeded from (seed, name), so values do not depend on parameter order, and a
    CUDA generator is used on CUDA.
    """
    dev, dt = _resolve(model, device, dtype)
    materialize_(model, dev, dt)
    layers = _layers_per_decoder(n for n, _ in model.named_parameters())
    gen = torch.Generator(device=dev)
    for name, p in model.named_parameters():
        kind, value = _fill_rule(name, p, std, layers)
        if kind == "const":
            p.fill_(value)
            continue
        gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        p.normal_(0.0, value, generator=gen)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
