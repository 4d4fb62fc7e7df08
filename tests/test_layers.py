"""Shared layers against the reference (transformers' qwen3_omni_moe) with copied weights."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from omni_rt.errors import ConfigError
from omni_rt.model import layers as L
from omni_rt.model.config import preset

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as M  # noqa: E402
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (  # noqa: E402
    Qwen3OmniMoeConfig,
)

logging.getLogger("transformers").setLevel(logging.ERROR)


def hf_config(cfg):
    return Qwen3OmniMoeConfig(**cfg.to_hf())


def randomize(module: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)


# --- RMSNorm -------------------------------------------------------------------------------------------


def test_rmsnorm_matches_reference_in_bf16():
    ref = M.Qwen3OmniMoeThinkerTextRMSNorm(64, eps=1e-6)
    ours = L.RMSNorm(64, eps=1e-6)
    randomize(ref, 1, std=1.0)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, 64) * 4
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    assert torch.equal(ours(xb), ref(xb))


# --- RoPE ----------------------------------------------------------------------------------------------


def real_rotary_config(sections=(24, 20, 20), head_dim=128):
    cfg = preset("tiny")
    th = replace(cfg.thinker, head_dim=head_dim, mrope_section=sections, rope_theta=1e6)
    return replace(cfg, thinker=th)


@pytest.mark.parametrize("sections,head_dim", [((24, 20, 20), 128), ((4, 2, 2), 16)])
def test_mrope_matches_reference_for_distinct_thw(sections, head_dim):
    cfg = real_rotary_config(sections, head_dim)
    ref = M.Qwen3OmniMoeThinkerTextRotaryEmbedding(hf_config(cfg).thinker_config.text_config)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 3000, (3, 2, 7), generator=g)  # t, h, w all different
    x = torch.zeros(1, dtype=torch.float32)
    cos_ref, sin_ref = ref(x, pos)
    cos, sin = L.rope_cos_sin(pos, head_dim, cfg.thinker.rope_theta, sections)
    torch.testing.assert_close(cos, cos_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, sin_ref, rtol=0, atol=1e-6)
    # not trivially equal to plain RoPE of any one component: the h/w frequencies really differ
    cos_t, _ = L.rope_cos_sin(pos[0], head_dim, cfg.thinker.rope_theta)
    assert not torch.allclose(cos, cos_t)


def test_mrope_with_equal_thw_is_plain_rope():
    pos = torch.arange(50).view(1, 50).repeat(2, 1) + torch.tensor([[0], [17]])  # [B, T]
    plain = L.rope_cos_sin(pos, 128, 1e6)
    from_text = L.rope_cos_sin(pos, 128, 1e6, (24, 20, 20))
    from_thw = L.rope_cos_sin(pos.expand(3, -1, -1), 128, 1e6, (24, 20, 20))
    for a, b in zip(plain, from_text, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(plain, from_thw, strict=True):
        assert torch.equal(a, b)


def test_rotary_rejects_bad_sections():
    with pytest.raises(ConfigError):
        L.Rotary(128, 1e6, (24, 20, 10))


# --- MoE -----------------------------------------------------------------------------------------------

IMPLS = ["loop", "gather", "grouped_mm"]


def _skip_if_no_grouped_mm(impl):
    if impl == "grouped_mm" and L._grouped_mm_fn() is None:
        pytest.skip("this torch has no grouped_mm")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("experts,top_k,norm", [(8, 2, True), (16, 4, False)])
def test_thinker_moe_matches_reference(impl, experts, top_k, norm):
    _skip_if_no_grouped_mm(impl)
    cfg = preset("tiny")
    th = replace(cfg.thinker, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm)
    ref = M.Qwen3OmniMoeThinkerTextSparseMoeBlock(
        hf_config(replace(cfg, thinker=th)).thinker_config.text_config
    )
    randomize(ref, experts)
    ours = L.SparseMoe(th, impl=impl)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(3, 11, th.hidden_size)
    with torch.no_grad():
        want = ref(x)
        got = ours(x)
    exact = impl in ("loop", "grouped_mm")  # same per-expert GEMMs and summation order as the reference
    torch.testing.assert_close(got, want, rtol=0 if exact else 1e-5, atol=1e-6 if exact else 1e-5)
    assert want.abs().max() > 1e-2  # the test is not comparing zeros


@pytest.mark.parametrize("impl", IMPLS)
def test_talker_moe_with_shared_expert_matches_reference(impl):
    _skip_if_no_grouped_mm(impl)
    cfg = preset("tiny")
    ref = M.Qwen3OmniMoeTalkerTextSparseMoeBlock(hf_config(cfg).talker_config.text_config)
    randomize(ref, 7)
    ours = L.SparseMoe(cfg.talker, impl=impl)
    assert set(ours.state_dict()) == set(ref.state_dict())
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 9, cfg.talker.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


def test_moe_bf16_routing_weights_in_activation_dtype():
    cfg = preset("tiny")
    ref = M.Qwen3OmniMoeThinkerTextSparseMoeBlock(hf_config(cfg).thinker_config.text_config)
    randomize(ref, 3)
    ours = L.SparseMoe(cfg.thinker, impl="loop")
    ours.load_state_dict(ref.state_dict())
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = torch.randn(2, 6, cfg.thinker.hidden_size, dtype=torch.bfloat16)
    w, _ = ours.route(x.view(-1, cfg.thinker.hidden_size))
    assert w.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))


def test_moe_external_experts_fn_is_used():
    cfg = preset("tiny")
    moe = L.SparseMoe(cfg.thinker, impl="loop")
    randomize(moe, 4)
    calls = []

    def fn(x, ids, w, gate_up, down):
        calls.append(tuple(x.shape))
        return L.experts_gather(x, ids, w, gate_up, down)

    x = torch.randn(1, 4, cfg.thinker.hidden_size)
    with torch.no_grad():
        want = moe(x)
        moe.experts_fn = fn
        torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-6)
    assert calls == [(4, cfg.thinker.hidden_size)]


def test_moe_rejects_bad_settings():
    cfg = preset("tiny")
    with pytest.raises(ConfigError):
        L.SparseMoe(cfg.thinker, impl="fast")
    with pytest.raises(ConfigError):
        L.SparseMoe(replace(cfg.thinker, num_experts_per_tok=9))


def test_dense_mlp_matches_reference():
    cfg = preset("tiny")
    ref = M.Qwen3OmniMoeMLP(hf_config(cfg).talker_config.code_predictor_config)
    randomize(ref, 5)
    ours = L.MLP(cfg.code_predictor.hidden_size, cfg.code_predictor.intermediate_size)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 3, cfg.code_predictor.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x))


# --- Attention with the static cache --------------------------------------------------------------------


def make_attention(seed=0):
    cfg = preset("tiny").thinker
    attn = L.Attention(cfg, layer_idx=1)
    randomize(attn, seed, std=0.2)
    with torch.no_grad():  # norms near 1, as trained models have them
        attn.q_norm.weight.add_(1.0)
        attn.k_norm.weight.add_(1.0)
    return cfg, attn.eval()


def run_attn(cfg, attn, x, cache, slot, start):
    """x [1, T, H] written at positions start..start+T-1 of `slot`."""
    t = x.shape[1]
    pos = torch.arange(start, start + t).view(1, t)
    cos, sin = L.rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, cfg.mrope_section)
    return attn(x, cos, sin, cache, torch.tensor([slot]), pos)


def test_attention_full_causal_matches_reference():
    cfg, attn = make_attention()
    hf = hf_config(preset("tiny")).thinker_config.text_config
    hf._attn_implementation = "sdpa"
    ref = M.Qwen3OmniMoeThinkerTextAttention(hf, layer_idx=1).eval()
    ref.load_state_dict(attn.state_dict(), strict=True)
    x = torch.randn(2, 13, cfg.hidden_size)
    pos = torch.arange(13).view(1, 13).expand(2, -1)
    cos, sin = L.rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, cfg.mrope_section)
    cache = L.KVCache(4, 3, cfg.num_key_value_heads, 32, cfg.head_dim)
    with torch.no_grad():
        got = attn(x, cos, sin, cache, torch.tensor([2, 0]), pos)
        want, _ = ref(x, (cos, sin), attention_mask=None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the k/v rows were written into the chosen slots of this layer only
    assert cache.k[1, 2, :, :13].abs().sum() > 0 and cache.k[1, 0, :, :13].abs().sum() > 0
    assert cache.k[1, 1].abs().sum() == 0 and cache.k[0].abs().sum() == 0
    assert cache.k[1, :, :, 13:].abs().sum() == 0


def test_prefill_then_decode_equals_full_forward():
    cfg, attn = make_attention(1)
    x = torch.randn(1, 12, cfg.hidden_size)
    with torch.no_grad():
        full = run_attn(cfg, attn, x, L.KVCache(4, 2, cfg.num_key_value_heads, 16, cfg.head_dim), 0, 0)
        cache = L.KVCache(4, 2, cfg.num_key_value_heads, 16, cfg.head_dim)
        # stale garbage in the slot from an earlier occupant must not matter
        cache.k.normal_()
        cache.v.normal_()
        parts = [run_attn(cfg, attn, x[:, :7], cache, 1, 0)]
        for p in range(7, 12):
            parts.append(run_attn(cfg, attn, x[:, p : p + 1], cache, 1, p))
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_two_slots_at_different_lengths_decode_together():
    cfg, attn = make_attention(2)
    n_kv, d = cfg.num_key_value_heads, cfg.head_dim
    a, b = torch.randn(1, 5, cfg.hidden_size), torch.randn(1, 9, cfg.hidden_size)
    step = torch.randn(2, 1, cfg.hidden_size)  # the next token of each
    with torch.no_grad():
        solo = []
        for i, (seq, slot) in enumerate([(a, 0), (b, 2)]):
            cache = L.KVCache(4, 3, n_kv, 16, d)
            run_attn(cfg, attn, seq, cache, slot, 0)
            solo.append(run_attn(cfg, attn, step[i : i + 1], cache, slot, seq.shape[1]))
        cache = L.KVCache(4, 3, n_kv, 16, d)
        run_attn(cfg, attn, a, cache, 0, 0)
        run_attn(cfg, attn, b, cache, 2, 0)
        pos = torch.tensor([[5], [9]])
        cos, sin = L.rope_cos_sin(pos, d, cfg.rope_theta, cfg.mrope_section)
        together = attn(step, cos, sin, cache, torch.tensor([0, 2]), pos)
    torch.testing.assert_close(together, torch.cat(solo), rtol=1e-5, atol=1e-5)


def test_decoder_layer_moe_and_dense():
    cfg = preset("tiny")
    moe_layer = L.DecoderLayer(cfg.thinker, 0)
    dense_layer = L.DecoderLayer(cfg.code_predictor, 0)
    assert isinstance(moe_layer.mlp, L.SparseMoe) and isinstance(dense_layer.mlp, L.MLP)
    ref = M.Qwen3OmniMoeThinkerTextDecoderLayer(hf_config(cfg).thinker_config.text_config, 0)
    assert set(moe_layer.state_dict()) == set(ref.state_dict())


def test_kvcache_shape_and_errors():
    c = L.KVCache(2, 3, 4, 10, 8, dtype=torch.bfloat16)
    assert c.k.shape == (2, 3, 4, 10, 8) and c.v.dtype == torch.bfloat16
    assert (c.n_slots, c.max_len) == (3, 10)
    c.k.fill_(1.0)
    c.reset(1)
    assert c.k[:, 1].abs().sum() == 0 and c.k[:, 0].abs().sum() > 0
    with pytest.raises(ConfigError):
        L.KVCache(2, 0, 4, 10, 8)


def test_kv_len_limits_the_rows_read_and_keeps_results():
    cfg, attn = make_attention(3)
    x = torch.randn(1, 6, cfg.hidden_size)
    pos = torch.arange(6).view(1, 6)
    cos, sin = L.rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, cfg.mrope_section)
    with torch.no_grad():
        full = attn(
            x, cos, sin, L.KVCache(4, 1, cfg.num_key_value_heads, 32, cfg.head_dim), torch.tensor([0]), pos
        )
        cache = L.KVCache(4, 1, cfg.num_key_value_heads, 32, cfg.head_dim)
        short = attn(x, cos, sin, cache, torch.tensor([0]), pos, kv_len=8)
    torch.testing.assert_close(short, full, rtol=1e-5, atol=1e-6)

    seen = {}

    def spy(q, k_cache, v_cache, slots, positions, mask, kv_len):
        seen["mask"], seen["kv_len"] = tuple(mask.shape), kv_len
        return L.attend(q, k_cache, v_cache, slots, positions, mask, kv_len)

    attn.attn_fn = spy  # the seam a fused attention kernel plugs into
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin, cache, torch.tensor([0]), pos, kv_len=8), full)
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    assert seen == {"mask": (1, 1, rep * 6, 8), "kv_len": 8}


def test_attention_mask_folds_head_groups():
    m = L.attention_mask(torch.tensor([[2, 3]]), kv_len=5, rep=2)  # [1, 1, 4, 5]
    want = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    assert torch.equal(m[0, 0], torch.cat([want, want]))
