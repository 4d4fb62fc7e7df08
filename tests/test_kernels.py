"""The MoE decode kernel and its sibling paths against the fp32 reference, on the CPU.

The Triton kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is first imported);
when Triton is not installed those tests skip with the reason, and the plain-PyTorch tests still run.
"""

import pytest
import torch
from omni_rt.kernels import moe_decode as md
from triton_env import needs_triton


def _problem(n, k, e, h, inter, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    gate_up = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    down = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(n, e, generator=g)
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    return hidden, ids, w, gate_up, down


def _per_token_truth(hidden, ids, w, gate_up, down):
    """An independent spelling of the maths, token by token, slot by slot, in float64."""
    inter = down.shape[-1]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        x = hidden[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = gate_up[e].double() @ x
            a = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[t] += float(w[t, j]) * (down[e].double() @ a)
    return out


def test_reference_matches_per_token_truth():
    hidden, ids, w, gu, dn = _problem(n=3, k=2, e=5, h=24, inter=12)
    got = md.moe_decode_reference(hidden, ids, w, gu, dn)
    torch.testing.assert_close(got.double(), _per_token_truth(hidden, ids, w, gu, dn), rtol=1e-5, atol=1e-5)


def test_loop_and_grouped_mm_match_reference():
    hidden, ids, w, gu, dn = _problem(n=5, k=3, e=6, h=32, inter=16)
    ref = md.moe_decode_reference(hidden, ids, w, gu, dn)
    torch.testing.assert_close(md.moe_loop(hidden, ids, w, gu, dn), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(md.moe_grouped_mm(hidden, ids, w, gu, dn), ref, rtol=1e-5, atol=1e-5)


def test_weights_change_output():
    # A routing weight of zero must remove that expert's contribution entirely.
    hidden, ids, w, gu, dn = _problem(n=2, k=2, e=4, h=16, inter=8)
    w0 = w.clone()
    w0[:, 1] = 0
    only_first = md.moe_decode_reference(hidden, ids[:, :1], w0[:, :1], gu, dn)
    torch.testing.assert_close(md.moe_decode_reference(hidden, ids, w0, gu, dn), only_first)


@needs_triton
@pytest.mark.parametrize(
    "n,k,e,h,inter",
    [
        (1, 2, 4, 32, 16),  # one token, the decode case
        (3, 3, 5, 48, 24),  # shapes not multiples of the blocks: masks must hold
        (2, 2, 3, 40, 20),
    ],
)
def test_triton_kernel_matches_reference(n, k, e, h, inter):
    hidden, ids, w, gu, dn = _problem(n, k, e, h, inter, seed=n + e)
    ref = md.moe_decode_reference(hidden, ids, w, gu, dn)
    got = md.moe_decode_triton(hidden, ids, w, gu, dn, block_i=8, block_h=16, block_h_down=8, block_i_down=16)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_triton
def test_triton_kernel_same_expert_twice_and_strided_weights():
    # Two tokens routed to the same experts, weights given as a non-contiguous expert slice.
    hidden, _, w, gu, dn = _problem(n=2, k=2, e=6, h=32, inter=16)
    ids = torch.tensor([[4, 2], [2, 4]])
    gu_s, dn_s = gu[::2], dn[::2]  # experts 0, 2, 4 -> strided along E
    ids_s = ids // 2
    ref = md.moe_decode_reference(hidden, ids_s, w, gu_s, dn_s)
    got = md.moe_decode_triton(
        hidden, ids_s, w, gu_s, dn_s, block_i=8, block_h=16, block_h_down=8, block_i_down=16
    )
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_triton
def test_triton_kernel_bf16_within_bf16_tolerance():
    hidden, ids, w, gu, dn = _problem(n=2, k=2, e=4, h=64, inter=32, dtype=torch.bfloat16)
    ref = md.moe_decode_reference(hidden, ids, w, gu, dn)
    got = md.moe_decode_triton(
        hidden, ids, w, gu, dn, block_i=16, block_h=32, block_h_down=16, block_i_down=32
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


@needs_triton
def test_install_swaps_expert_fn_and_dispatches_by_token_count():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts_fn = md.moe_loop

    model = torch.nn.Sequential(Block(), torch.nn.Linear(2, 2), Block())
    assert md.install(model, "triton") == 2
    fn = model[0].experts_fn
    assert fn is model[2].experts_fn and fn.__name__ == "moe_triton_decode"
    hidden, ids, w, gu, dn = _problem(n=3, k=2, e=4, h=16, inter=8)
    ref = md.moe_decode_reference(hidden, ids, w, gu, dn)
    torch.testing.assert_close(fn(hidden, ids, w, gu, dn), ref, rtol=1e-5, atol=1e-5)
    # Above decode_max_tokens the prefill path is taken; it must agree too.
    many = md.make_experts_fn("triton", decode_max_tokens=1)
    torch.testing.assert_close(many(hidden, ids, w, gu, dn), ref, rtol=1e-5, atol=1e-5)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="moe_backend"):
        md.make_experts_fn("cutlass")
