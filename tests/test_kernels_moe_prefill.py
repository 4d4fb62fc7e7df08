"""The MoE prefill kernel (kernels/moe_prefill) against `moe_loop` and `moe_grouped_mm`, on the CPU.

The kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is first imported) at tiny
shapes with 16-wide tiles, so the masks, padding rows and empty blocks are all exercised. In fp32 the
dots are IEEE fp32, so the kernel equals the loop to fp32 rounding of a different summation order; in
bf16 it rounds where `moe_grouped_mm` rounds. Without Triton these tests skip with the reason.
"""

import pytest
import torch
from omni_rt.kernels import moe_decode as md
from omni_rt.kernels import moe_prefill as mp
from test_kernels import _problem  # the same random MoE problems as the decode kernel's tests
from torch.utils._python_dispatch import TorchDispatchMode
from triton_env import needs_triton

pytestmark = needs_triton

TILES = dict(block_m=16, block_n=16, block_k=16, block_n_down=16, block_k_down=16)
FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def _check_align(ids, e, block_m):
    sorted_pairs, block_expert, block_rows = mp.moe_prefill_align(ids, e, block_m)
    flat = ids.reshape(-1)
    nb = mp.num_row_blocks(flat.numel(), e, block_m)
    assert block_expert.shape == (nb,) and sorted_pairs.shape == (nb * block_m,)
    seen = []
    last_expert = -1
    for b in range(nb):
        ex, rows = int(block_expert[b]), int(block_rows[b])
        if ex < 0:
            assert rows == 0
            last_expert = e  # only unused blocks may follow
            continue
        assert ex >= last_expert and 0 < rows <= block_m  # experts ascending, no empty used block
        last_expert = ex
        pairs = sorted_pairs[b * block_m : b * block_m + rows].tolist()
        assert all(int(flat[p]) == ex for p in pairs)
        seen += pairs
    assert seen == sorted(seen, key=lambda p: (int(flat[p]), p))  # grouped by expert, stable
    assert sorted(seen) == list(range(flat.numel()))  # every pair exactly once


@pytest.mark.parametrize("n,k,e,block_m", [(5, 3, 8, 16), (37, 8, 16, 16), (20, 6, 128, 16), (9, 2, 4, 32)])
def test_align_groups_every_pair_once(n, k, e, block_m):
    _, ids, *_ = _problem(n, k, e, 16, 16, seed=n)
    _check_align(ids, e, block_m)


def test_align_all_tokens_on_few_experts():
    ids = torch.tensor([[3, 0]] * 21)  # experts 1, 2 empty; 3 and 0 get two blocks each
    _check_align(ids, 4, 16)


@pytest.mark.parametrize(
    "n,k,e,h,inter",
    [
        (16, 8, 16, 32, 16),  # one tile everywhere
        (21, 6, 8, 48, 40),  # N, H and I not multiples of the tiles: masks must hold
        (37, 8, 12, 32, 32),  # several blocks per expert
        (5, 6, 128, 32, 16),  # many experts, most of them empty
    ],
)
def test_matches_loop_fp32(n, k, e, h, inter):
    hidden, ids, w, gu, dn = _problem(n, k, e, h, inter, seed=n + e)
    got = mp.moe_prefill_triton(hidden, ids, w, gu, dn, **TILES)
    torch.testing.assert_close(got, md.moe_loop(hidden, ids, w, gu, dn), **FP32_TOL)


def test_all_tokens_on_one_expert_and_strided_weights():
    hidden, _, w, gu, dn = _problem(n=19, k=2, e=6, h=32, inter=16)
    ids = torch.tensor([[4, 2]] * 19)  # expert 4 gets every token's first slot: two row blocks
    gu_s, dn_s, ids_s = gu[::2], dn[::2], ids // 2  # experts 0, 2, 4: strided along E
    got = mp.moe_prefill_triton(hidden, ids_s, w, gu_s, dn_s, **TILES)
    torch.testing.assert_close(got, md.moe_loop(hidden, ids_s, w, gu_s, dn_s), **FP32_TOL)


def test_bf16_rounds_like_grouped_mm():
    hidden, ids, w, gu, dn = _problem(n=21, k=8, e=16, h=64, inter=32, dtype=torch.bfloat16, seed=3)
    got = mp.moe_prefill_triton(hidden, ids, w, gu, dn, **TILES)
    assert got.dtype == torch.bfloat16
    ref = md.moe_decode_reference(hidden.float(), ids, w.float(), gu.float(), dn.float())  # fp32 truth
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
    # grouped_mm's rounding points, so only summation order differs: within a bf16 ulp or two
    gm = md.moe_grouped_mm(hidden, ids, w, gu, dn)
    torch.testing.assert_close(got.float(), gm.float(), rtol=1.6e-2, atol=1e-3)
    assert (got == gm).float().mean() > 0.9


def test_zero_weight_removes_expert():
    hidden, ids, w, gu, dn = _problem(n=17, k=2, e=8, h=32, inter=16)
    w[:, 1] = 0
    got = mp.moe_prefill_triton(hidden, ids, w, gu, dn, **TILES)
    only_first = md.moe_loop(hidden, ids[:, :1], w[:, :1], gu, dn)
    torch.testing.assert_close(got, only_first, **FP32_TOL)


class _Recorder:
    """Stands in for a Triton kernel: records each launch's grid, then launches the real kernel."""

    def __init__(self, kernel, grids):
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append((self.kernel.fn.__name__, tuple(grid)))
        return self.kernel[grid]


def test_static_shapes_and_no_host_sync(monkeypatch):
    """Grids and buffer shapes depend on (N, k, E, H, I) only, never on the routing; no op reads a
    device value on the host (`.item()`, `.tolist()`, `nonzero` would show up as these aten ops)."""
    grids: list = []
    for name in ("_align", "_gate_up_act", "_down", "_combine"):
        monkeypatch.setattr(mp, name, _Recorder(getattr(mp, name), grids))
    hidden, ids, w, gu, dn = _problem(n=18, k=3, e=8, h=32, inter=16)
    routings = [ids, torch.zeros_like(ids) + torch.arange(3), ids.flip(0)]  # spread / all on 0, 1, 2

    class SyncSpy(TorchDispatchMode):
        ops: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    per_routing = []
    for r in routings:
        grids.clear()
        with SyncSpy():
            got = mp.moe_prefill_triton(hidden, r, w, gu, dn, **TILES)
        per_routing.append(list(grids))
        torch.testing.assert_close(got, md.moe_loop(hidden, r, w, gu, dn), **FP32_TOL)
    assert len(per_routing[0]) == 4 and all(g == per_routing[0] for g in per_routing)
    assert not SyncSpy.ops & {"_local_scalar_dense", "nonzero", "item", "unique", "_unique2", "bincount"}


def test_bad_inputs_are_clear_errors():
    hidden, ids, w, gu, dn = _problem(n=4, k=2, e=4, h=16, inter=16)
    with pytest.raises(ValueError, match="shape mismatch"):
        mp.moe_prefill_triton(hidden[:, :8], ids, w, gu, dn)
    with pytest.raises(ValueError, match="dtype"):
        mp.moe_prefill_triton(hidden.bfloat16(), ids, w, gu, dn)
    with pytest.raises(ValueError, match="power of two"):
        mp.moe_prefill_triton(hidden, ids, w, gu, dn, block_m=8)
