"""Packed projections: one GEMM where the plain model runs two or three on the same input.

Attention's q, k and v projections read the same x, and so do a dense MLP's gate and up projections. At
decode each is a small GEMV whose launch costs about as much as its bytes (docs/performance.md: 4-9 µs
per cuBLAS launch for 2-13 MB of weights), so the plain path pays two extra launches per attention layer
and one per dense MLP: per code-predictor frame (15 steps x 5 layers) that is 225 launches.

    from omni_rt.kernels import packed
    packed.install_packed(model)      # {"attention": n, "mlp": n}
    packed.uninstall_packed(model)    # back to the plain forward (the packed storage stays; same values)

`install_packed` copies [q; k; v] (and [gate; up]) into one weight per module and re-points the separate
projections' weights at row slices of it, so there is no second copy and the plain path, which still
calls the separate projections, reads the same values. It then fills `Attention.proj_fn` and replaces
`MLP.forward` with versions that run one GEMM and split its output into views (no copy; the fused q/k
norm kernel and `qk_norm_rope_cache` both take row-strided q, k, v). Plain PyTorch, no Triton: it runs
on any device. Results equal the plain path's up to the GEMM's summation order (cuBLAS picks its kernel
by shape), so in bf16 a value can differ by an ulp; install before capturing CUDA graphs, which keep the
launches they recorded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_rt.model import layers

PACKED_ATTR = "_omni_packed"  # marks what install_packed set, so uninstall_packed removes only that


def pack_linears(module: nn.Module, names: tuple[str, ...]) -> torch.Tensor:
    """One [sum N_i, H] weight holding the named Linear layers' weights; theirs become row slices of it.
    Kept on the module (a plain attribute, not in the state dict); a second install reuses it."""
    linears = [getattr(module, n) for n in names]
    old = module.__dict__.get("_packed_weight")
    if old is not None and linears[0].weight.data_ptr() == old.data_ptr():
        return old
    weights = [lin.weight for lin in linears]
    first = weights[0]
    if any(
        w.dtype != first.dtype or w.device != first.device or w.shape[1] != first.shape[1] for w in weights
    ):
        raise ValueError(f"{type(module).__name__}: {names} differ in dtype, device or input size")
    with torch.no_grad():
        packed = torch.cat([w.detach() for w in weights], dim=0)
    off = 0
    for lin, w in zip(linears, weights, strict=True):
        n = w.shape[0]
        lin.weight = nn.Parameter(packed[off : off + n], requires_grad=w.requires_grad)
        off += n
    object.__setattr__(module, "_packed_weight", packed)
    return packed


def _proj_fn(packed: torch.Tensor, sizes: list[int]):
    def proj(attn: layers.Attention, x: torch.Tensor):
        return F.linear(x, packed).split(sizes, dim=-1)  # q, k, v: views of one GEMM's output

    setattr(proj, PACKED_ATTR, "attention")
    return proj


def packed_mlp_forward(mlp: nn.Module, packed: torch.Tensor):
    """A gate/up/down MLP's `forward` with gate and up as one GEMM over `packed` (`pack_linears`), unmarked:
    also Code2Wav's MLP (`kernels/code2wav_step.py`, which marks it as its own hook)."""
    inter = mlp.gate_proj.weight.shape[0]

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, packed).split(inter, dim=-1)
        return mlp.down_proj(F.silu(gate) * up)

    return forward


def _mlp_forward(mlp: layers.MLP, packed: torch.Tensor):
    forward = packed_mlp_forward(mlp, packed)
    setattr(forward, PACKED_ATTR, "mlp")
    return forward


def install_packed(model: nn.Module) -> dict[str, int]:
    """Pack every Attention's q/k/v and every dense MLP's gate/up in `model`; modules changed per kind."""
    done = {"attention": 0, "mlp": 0}
    for m in model.modules():
        if isinstance(m, layers.Attention):
            packed = pack_linears(m, ("q_proj", "k_proj", "v_proj"))
            m.proj_fn = _proj_fn(
                packed, [m.q_proj.weight.shape[0], m.k_proj.weight.shape[0], m.v_proj.weight.shape[0]]
            )
            done["attention"] += 1
        elif isinstance(m, layers.MLP):
            packed = pack_linears(m, ("gate_proj", "up_proj"))
            m.forward = _mlp_forward(m, packed)
            done["mlp"] += 1
    return done


def uninstall_packed(model: nn.Module) -> int:
    """Remove what `install_packed` set (the weights stay packed: same values); returns how many."""
    removed = 0
    for m in model.modules():
        if hasattr(getattr(m, "proj_fn", None), PACKED_ATTR):
            m.proj_fn = None
            removed += 1
        if hasattr(m.__dict__.get("forward"), PACKED_ATTR):
            del m.forward
            removed += 1
    return removed
