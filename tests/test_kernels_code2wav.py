"""The fused Code2Wav step (kernels/code2wav_step.py) against the model code it replaces.

Each kernel runs in Triton's interpreter on the CPU against the plain line it stands for (bf16: bit-equal,
the kernels round where the plain path rounds; fp32: within fp32 rounding). Then the installed hooks on a
whole Code2Wav: a stream of chunks of several sizes, started afresh in the middle, gives the plain step's
PCM and leaves the same stream state; uninstalling restores the plain modules.
"""

import pytest
import torch
from omni_rt.kernels import code2wav_step as cs
from triton_env import needs_triton

from omni_rt.model import code2wav
from omni_rt.model.config import preset
from omni_rt.model.layers import apply_rope, rope_cos_sin

pytestmark = needs_triton

DTYPES = [torch.float32, torch.bfloat16]


def _same(got: torch.Tensor, ref: torch.Tensor) -> None:
    if got.dtype == torch.bfloat16:
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qk_is_apply_rope_on_q_and_k(dtype):
    g = torch.Generator().manual_seed(1)
    B, T, H, HK, D = 2, 3, 4, 2, 16
    qkv = torch.randn(B, T, (H + 2 * HK) * D, generator=g).to(dtype)  # one packed GEMM's output
    q, k, _ = qkv.split([H * D, HK * D, HK * D], dim=-1)  # row-strided views, as the hook passes them
    pos = torch.tensor([[5, 6, 7], [0, 1, 2]])
    cos, sin = rope_cos_sin(pos, D, 10000.0, dtype=dtype)
    gq, gk = cs.rope_qk(q, k, cos, sin, H, HK)
    _same(gq, apply_rope(q.reshape(B, T, H, D).transpose(1, 2), cos, sin))
    _same(gk, apply_rope(k.reshape(B, T, HK, D).transpose(1, 2), cos, sin))
    assert gq.shape == (B, H, T, D) and gk.shape == (B, HK, T, D)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_add_is_layer_scale_residual(dtype):
    g = torch.Generator().manual_seed(2)
    x, h = (torch.randn(2, 3, 40, generator=g) * 3).to(dtype), torch.randn(2, 3, 40, generator=g).to(dtype)
    scale = (torch.rand(40, generator=g) * 0.2).to(dtype)
    _same(cs.scale_add(x, scale, h), x + scale * h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_start_mask_is_the_started_masked_fill(dtype):
    g = torch.Generator().manual_seed(3)
    B, C, L, rate, lag = 3, 5, 37, 8, 20
    state = code2wav.Code2WavState(
        pos=torch.tensor([0, 1, 4]), k=torch.zeros(0), v=torch.zeros(0), key_pos=torch.zeros(0), conv={}
    )  # rows: a first chunk (20 samples before the stream), a second (none before), a later one
    started = state.started(rate, lag, L)
    x = torch.randn(B, C, 2 * L, generator=g).to(dtype)[..., ::2]  # strided along time
    y = torch.randn(B, C, L, generator=g).to(dtype)
    _same(cs.start_mask(x, state.pos, rate, lag), x.masked_fill(~started, 0.0))
    _same(cs.start_mask(x, state.pos, rate, lag, y=y), (x + y).masked_fill(~started, 0.0))
    assert (cs.start_mask(x, state.pos, rate, lag)[0, :, :lag] == 0).all()


@pytest.mark.parametrize("T", [1, 4, 6, 9])  # shorter than, equal to and longer than the context
def test_window_is_cat_then_context_update(T):
    g = torch.Generator().manual_seed(T)
    buf = torch.randn(2, 3, 6, generator=g)
    x = torch.randn(2, 3, 2 * T, generator=g)[..., ::2]  # strided input
    ref_w = torch.cat([buf, x], dim=-1)
    ref_buf = ref_w[..., -6:].clone()
    got = cs.window(buf, x)
    assert torch.equal(got, ref_w) and torch.equal(buf, ref_buf)


def test_window_of_ragged_rows_keeps_the_context_before_the_padding():
    # rows of a ragged chunk (Code2WavState.valid): each keeps the 6 samples before its first padded one
    g = torch.Generator().manual_seed(9)
    rate, T = 4, 3
    buf = torch.randn(3, 2, 6, generator=g)
    x = torch.randn(3, 2, rate * T, generator=g)
    valid = torch.tensor([0, 2, 3])  # frames of its own: none, some, all
    state = code2wav.Code2WavState(
        pos=torch.zeros(3), k=torch.zeros(0), v=torch.zeros(0), key_pos=torch.zeros(0), conv={}, valid=valid
    )
    ref_buf = buf.clone()
    ref_w = torch.cat([ref_buf, x], dim=-1)
    state.keep_context(ref_buf, ref_w, rate)
    assert torch.equal(ref_buf[0], buf[0]) and torch.equal(ref_buf[2], ref_w[2, :, -6:])  # the plain rule
    got = cs.window(buf, x, valid, rate)
    assert torch.equal(got, ref_w) and torch.equal(buf, ref_buf)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 300])  # one block, several
def test_conv_to_one_is_the_last_conv(dtype, T):
    g = torch.Generator().manual_seed(T)
    conv = torch.nn.Conv1d(12, 1, 7)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(1, 12, 7, generator=g) * 0.3)
        conv.bias.fill_(0.05)
    conv = conv.to(dtype)
    x = torch.randn(3, 12, T + 6, generator=g).to(dtype)
    got, ref = cs.conv_to_one(x, conv), conv(x)
    assert got.shape == ref.shape == (3, 1, T)
    # one rounding of an fp32 sum in both, in another order: within an ulp of the output dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-9)
    torch.testing.assert_close(got, ref, **tol)


def _model(dtype):
    cfg = preset("tiny").code2wav
    model = code2wav.Code2Wav(cfg).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.02 if "embedding" not in name else 1.0
            p.copy_(
                torch.randn(p.shape, generator=g) * std + (1.0 if "norm" in name and p.dim() == 1 else 0.0)
            )
    return model.to(dtype)


def _stream(model, codes, sizes, fresh_at):
    """PCM of the chunks of `codes` [B, Q, N] in `sizes`, the stream restarted before chunk `fresh_at`."""
    state = model.new_state(codes.shape[0])
    out, t = [], 0
    for i, n in enumerate(sizes):
        if i == fresh_at:
            state.reset()
            t = 0
        out.append(model.step(codes[..., t : t + n], state))
        t += n
    return out, state


@pytest.mark.parametrize("dtype", DTYPES)
def test_installed_step_keeps_the_streamed_pcm_and_state(dtype):
    model = _model(dtype)
    cfg = model.cfg
    codes = torch.randint(
        0, cfg.codebook_size, (2, cfg.num_quantizers, 12), generator=torch.Generator().manual_seed(5)
    )
    sizes, fresh_at = [1, 2, 4, 3, 1, 2], 4
    ref, ref_state = _stream(model, codes, sizes, fresh_at)
    n = cs.install_code2wav(model)
    try:
        got, state = _stream(model, codes, sizes, fresh_at)
    finally:
        from omni_rt.kernels import fused

        removed = fused.uninstall_all(model)
    blocks = len(cfg.upsample_rates)
    looking_back = sum(
        1
        for m in model.modules()
        if isinstance(m, code2wav.CausalConv1d | code2wav.CausalTransConv1d) and m.context
    )
    assert n == removed == 3 * cfg.num_hidden_layers + blocks + looking_back
    assert not any("forward" in m.__dict__ or "step" in m.__dict__ for m in model.modules())
    _same_stream(got, state, ref, ref_state, dtype)


def _same_stream(got, state, ref, ref_state, dtype) -> None:
    """The state bit-equal on the CPU, both dtypes (on a GPU cuBLAS may sum the packed GEMMs in another
    order); the PCM within rounding: the last conv sums in another order than the plain one."""
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=2**-8)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, **tol)
    for m, buf in ref_state.conv.items():
        assert torch.equal(state.conv[m], buf)
    assert torch.equal(state.k, ref_state.k) and torch.equal(state.v, ref_state.v)
    assert torch.equal(state.pos, ref_state.pos) and torch.equal(state.key_pos, ref_state.key_pos)


@pytest.mark.parametrize("dtype", DTYPES)
def test_installed_step_of_ragged_chunks_is_the_plain_one(dtype):
    # rows of one step with frames of their own 1, 3 and 0 (then 2, 0, 4): the fused window keeps each
    # row's context where the plain `keep_context` does, and the ring, positions and PCM agree
    model = _model(dtype)
    cfg = model.cfg
    codes = torch.randint(
        0, cfg.codebook_size, (3, cfg.num_quantizers, 7), generator=torch.Generator().manual_seed(6)
    )

    def run():
        state = model.new_state(3)
        out = []
        for valid, (a, b) in (([1, 3, 0], (0, 3)), ([2, 0, 4], (3, 7))):
            state.valid = torch.tensor(valid)
            out.append(model.step(codes[..., a:b], state))
        return out, state

    ref, ref_state = run()
    cs.install_code2wav(model)
    try:
        got, state = run()
    finally:
        from omni_rt.kernels import fused

        fused.uninstall_all(model)
    _same_stream(got, state, ref, ref_state, dtype)
    assert state.pos.tolist() == [3, 3, 4]
