"""Packed projections (kernels/packed.py): one GEMM for q/k/v and for gate/up, the same model outputs."""

import torch
from omni_rt.kernels import packed

from omni_rt.model import layers
from omni_rt.model.config import preset
from omni_rt.model.omni import OmniModel


def _decode(model):
    """A 2-sequence Thinker prefill + decode step, and one code-predictor frame (dense MLPs, 15 steps)."""
    th, tk = model.thinker, model.talker
    g = torch.Generator().manual_seed(3)
    cache = th.allocate_cache(2, 16)
    slots = torch.tensor([1, 0])
    with torch.no_grad():
        th(
            torch.randint(0, th.cfg.vocab_size, (2, 6), generator=g),
            torch.arange(6).expand(2, 6),
            cache,
            slots,
        )
        logits, _ = th(
            torch.randint(0, th.cfg.vocab_size, (2, 1), generator=g), torch.tensor([[6], [6]]), cache, slots
        )
        tk.code_predictor.setup_cache(1, "cpu", torch.float32)
        hidden = torch.randn(1, tk.cfg.talker.hidden_size, generator=g)
        codes = tk.predict_frame(hidden, torch.tensor([5]))
    return logits, cache.k.clone(), codes


def test_packed_projections_keep_outputs_and_share_storage():
    model = OmniModel.build(preset("tiny"), weights="random", seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ref_logits, ref_k, ref_codes = _decode(model)
    counts = packed.install_packed(model)
    attn = [m for m in model.modules() if isinstance(m, layers.Attention)]
    mlps = [m for m in model.modules() if isinstance(m, layers.MLP)]
    assert counts == {"attention": len(attn), "mlp": len(mlps)} and mlps
    a = attn[0]
    base = a.q_proj.weight.untyped_storage().data_ptr()
    # no second copy: q, k and v are row slices of one packed weight
    assert (
        a.k_proj.weight.untyped_storage().data_ptr() == base == a.v_proj.weight.untyped_storage().data_ptr()
    )
    assert packed.install_packed(model) == counts  # a second install reuses the packed storage
    assert a.q_proj.weight.untyped_storage().data_ptr() == base
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    logits, k, codes = _decode(model)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, ref_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(codes, ref_codes)
    assert packed.uninstall_packed(model) == len(attn) + len(mlps)
    assert all(m.proj_fn is None for m in attn) and not any("forward" in m.__dict__ for m in mlps)
    logits, _, _ = _decode(model)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_packed_projection_outputs_are_views_of_one_gemm():
    model = OmniModel.build(preset("tiny"), weights="random", seed=1)
    packed.install_packed(model)
    a = next(m for m in model.modules() if isinstance(m, layers.Attention))
    q, k, v = a.proj_fn(a, torch.randn(2, 3, a.q_proj.in_features))
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert q.shape[-1] == a.q_proj.out_features and k.shape[-1] == v.shape[-1] == a.k_proj.out_features
