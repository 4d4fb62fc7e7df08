"""bf16 parity with the reference on the CPU: the same weights give bit-equal logits and hidden states.

Both sides hold the SAME bf16 tensors (`omni_rt.bench.reference_model` hands ours to transformers'
model; its rotary tables stay fp32 as in a bf16 `from_pretrained`), so any difference is a difference in
where the two forwards round. The pairs of MoE backends round the same way: our `loop` and the
reference's `eager` (one index_add_ into the bf16 output per expert, in expert order), our `grouped_mm`
and its `grouped_mm` (per-(token, k) rows summed over k in one fp32-accumulated reduction). Across the two
pairs results differ in the last bit: that is the reference's own bf16 noise, not ours.

Attention must read the same rows: the reference's prefill attends over exactly the prompt (and its
code predictor over a growing dynamic cache), so ours is called with `kv_len` equal to the rows in use. With
more (masked) rows, as in the pipeline's length buckets, SDPA blocks the keys differently and the result
moves by an ulp here and there: `test_padded_kv_rows_stay_within_bf16_noise` bounds that.

Every comparison is exact (`torch.equal`), so moving a single cast (RMSNorm's weight multiply in fp32,
the router weights left in fp32, the code predictor attending over its whole 16-row cache, ...) fails here.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hf_fixtures import SMALL_CONFIGS

from omni_rt.bench import chat_prompt, reference_model
from omni_rt.model import layers as L
from omni_rt.model.omni import OmniModel
from omni_rt.model.talker import talker_prompt

pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)

CONFIGS = ["deep", "wide"]  # GQA 4:1, 16 experts top-4, 6 layers / 4 experts top-1, wider heads
# our MoE implementation -> the reference's experts_implementation that rounds the same way
BACKENDS = {"loop": "eager", "grouped_mm": "grouped_mm"}

_MODELS: dict = {}


def pair(reference, name: str):
    """(our bf16 OmniModel, the reference holding the same tensors), built once per config."""
    if name not in _MODELS:
        sd = {k: v for k, v in reference(name).state_dict().items() if not k.startswith("thinker.visual.")}
        # The fixtures keep transformers' init for vectors: norm weights of ones and zero biases, under
        # which rounding before or after the weight multiply (or the bias add) cannot show. Re-draw them.
        g = torch.Generator().manual_seed(7)
        for k, v in sd.items():
            if v.dim() == 1 and k.startswith(("thinker.model.", "talker.")):
                noise = torch.randn(v.shape, generator=g)
                sd[k] = 1 + 0.3 * noise if k.endswith("norm.weight") else 0.1 * noise
        ours = OmniModel.build(SMALL_CONFIGS[name], dtype=torch.bfloat16, weights=sd)
        ref, _ = reference_model(ours)
        _MODELS[name] = (ours, ref)
    return _MODELS[name]


def set_backend(ours, ref, impl: str) -> None:
    for m in ours.modules():
        if isinstance(m, L.SparseMoe):
            m.impl = impl
    ref.set_experts_implementation(BACKENDS[impl])


def assert_bits(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-equal, with the size of the difference in the message when not."""
    assert ours.dtype == ref.dtype == torch.bfloat16, (name, ours.dtype, ref.dtype)
    if not torch.equal(ours, ref):
        d = (ours.float() - ref.float()).abs()
        pytest.fail(
            f"{name}: not bit-equal: max |diff| {d.max():.3e}, {(d > 0).float().mean():.2%} of values differ"
        )


@pytest.mark.parametrize("impl", list(BACKENDS))
@pytest.mark.parametrize("name", CONFIGS)
@torch.no_grad()
def test_thinker_prefill_and_decode_bit_equal(reference, name, impl):
    ours, ref = pair(reference, name)
    set_backend(ours, ref, impl)
    prompt = chat_prompt(system_len=20, user_len=24, seed=1, ids=SMALL_CONFIGS[name].ids)  # 57 ids
    t = len(prompt)
    # a cache of T + 1 rows, prefilled with kv_len = T (the prompt's rows), then one step at kv_len = T + 1
    ids = torch.tensor([prompt])
    cache = ours.thinker.allocate_cache(1, t + 1)
    slots = torch.zeros(1, dtype=torch.long)
    outs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda m, i, o: outs.append(o)) for m in ours.thinker.model.layers]
    try:
        logits, _ = ours.thinker(ids, torch.arange(t)[None], cache, slots, kv_len=t)
    finally:
        for h in hooks:
            h.remove()
    r = ref.thinker(input_ids=ids, output_hidden_states=True, use_cache=True)
    # hidden_states[k] is the output of layer k-1, except the last entry, which is after the final norm
    for k, out in enumerate(outs[:-1]):
        assert_bits(f"layer {k} output", out, r.hidden_states[k + 1])
    assert_bits("prefill logits", logits, r.logits)
    assert (logits.argmax(-1) == r.logits.argmax(-1)).all()  # greedy agreement at all 57 positions

    nxt = r.logits[:, -1:].argmax(-1)  # [1, 1]
    step, _ = ours.thinker(nxt, torch.tensor([[t]]), cache, slots, kv_len=t + 1)
    rs = ref.thinker(input_ids=nxt, past_key_values=r.past_key_values, use_cache=True)
    assert_bits("decode step logits", step, rs.logits)


@pytest.mark.parametrize("impl", list(BACKENDS))
@pytest.mark.parametrize("name", CONFIGS)
@torch.no_grad()
def test_talker_prefill_step_and_code_predictor_bit_equal(reference, name, impl):
    ours, ref = pair(reference, name)
    set_backend(ours, ref, impl)
    cfg = SMALL_CONFIGS[name]
    prompt = chat_prompt(system_len=6, user_len=12, seed=2, ids=cfg.ids)
    tp = talker_prompt(ours.talker, ours.thinker.embed, prompt, cfg.speaker_id("ethan"), 9707)  # [L, Ht]
    n = tp.shape[0]
    x = tp[None]
    # the text projection is the Talker's input: compare it on its own too (biases, SiLU in bf16)
    emb = ours.thinker.embed(torch.tensor(prompt))
    assert_bits("text_projection", ours.talker.project_text(emb), ref.talker.text_projection(emb))
    assert_bits("hidden_projection", ours.talker.hidden_projection(emb), ref.talker.hidden_projection(emb))

    cache = ours.talker.allocate_cache(1, n + 1)
    slots = torch.zeros(1, dtype=torch.long)
    logits, hidden = ours.talker(x, torch.arange(n)[None], cache, slots, kv_len=n)
    r = ref.talker.model(inputs_embeds=x, use_cache=True, past_key_values=DynamicCache())
    assert_bits("talker prefill hidden", hidden, r.last_hidden_state)
    assert_bits("talker prefill logits", logits, ref.talker.codec_head(r.last_hidden_state))

    # code predictor of frame 0, teacher-forced with the reference's greedy codes, logits of all 15 heads
    code0 = logits[:, -1].argmax(-1)  # [1]
    cp = ref.talker.code_predictor
    h = torch.cat([hidden[:, -1:], ref.talker.model.codec_embedding(code0)[:, None]], dim=1)  # [1, 2, Ht]
    ref_logits, ref_codes, past = [], [], DynamicCache()
    for g in range(cfg.num_code_groups - 1):
        o = cp.model(inputs_embeds=h, past_key_values=past, use_cache=True)
        ref_logits.append(cp.lm_head[g](o.last_hidden_state[:, -1]))
        ref_codes.append(ref_logits[-1].argmax(-1))
        h = cp.model.get_input_embeddings()[g](ref_codes[-1])[:, None]
    seen: list[torch.Tensor] = []

    def forced(lg: torch.Tensor) -> torch.Tensor:
        seen.append(lg)
        return ref_codes[len(seen) - 1]

    frame = ours.talker.predict_frame(hidden[:, -1], code0, forced)  # [1, 16]
    for g, (a, b) in enumerate(zip(seen, ref_logits, strict=True)):
        assert_bits(f"code predictor head {g}", a, b)
    assert frame[0, 1:].tolist() == [int(c) for c in ref_codes]

    # one decode step: the frame's 16 code embeddings + a projected text token
    step_in = (
        ours.talker.embed_codes(frame) + ours.talker.project_text(ours.thinker.embed(torch.tensor([11])))
    )[:, None]
    s_logits, _ = ours.talker(step_in, torch.tensor([[n]]), cache, slots, kv_len=n + 1)
    rs = ref.talker.model(inputs_embeds=step_in, past_key_values=r.past_key_values, use_cache=True)
    assert_bits("talker step logits", s_logits, ref.talker.codec_head(rs.last_hidden_state))


@torch.no_grad()
def test_padded_kv_rows_stay_within_bf16_noise(reference):
    """kv_len above the rows in use (the pipeline's length buckets): not bit-equal, but within the size of
    the reference's own difference between its two MoE backends, and the greedy tokens agree."""
    name = "deep"
    ours, ref = pair(reference, name)
    prompt = chat_prompt(system_len=20, user_len=24, seed=1, ids=SMALL_CONFIGS[name].ids)
    ids = torch.tensor([prompt])
    t = len(prompt)
    set_backend(ours, ref, "grouped_mm")
    ref_gmm = ref.thinker(input_ids=ids, use_cache=False).logits
    ref.set_experts_implementation("eager")
    ref_eager = ref.thinker(input_ids=ids, use_cache=False).logits
    noise = (ref_gmm.float() - ref_eager.float()).abs().max()
    assert noise > 0  # the two backends of the reference do round differently

    cache = ours.thinker.allocate_cache(1, 64)  # 7 masked rows beyond the prompt
    padded, _ = ours.thinker(ids, torch.arange(t)[None], cache, torch.zeros(1, dtype=torch.long))
    err = (padded.float() - ref_gmm.float()).abs().max()
    assert 0 < err <= noise, f"padded kv rows: max |diff| {err:.3e}, reference backend noise {noise:.3e}"
    agree = (padded.argmax(-1) == ref_gmm.argmax(-1)).float().mean()
    assert agree >= 55 / 57, f"greedy agreement {agree:.3f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_prefill_path_is_the_masked_attention(dtype):
    """t == kv_len takes SDPA's causal path (the reference's call); it must equal the masked path, for GQA
    and several slots, to fp32 accuracy (and within bf16 rounding in bf16)."""
    g = torch.Generator().manual_seed(0)
    b, heads, kv, t, d = 2, 6, 2, 9, 16
    q = torch.randn(b, heads, t, d, generator=g).to(dtype)
    k_cache = torch.randn(4, kv, t, d, generator=g).to(dtype)
    v_cache = torch.randn(4, kv, t, d, generator=g).to(dtype)
    slots = torch.tensor([3, 1])
    positions = torch.arange(t).expand(b, t)
    mask = L.attention_mask(positions, t, heads // kv)
    causal = L.attend(q, k_cache, v_cache, slots, positions, mask, t)
    # the same rows through the masked path: one extra (masked) row in the cache makes t != kv_len
    pad = torch.zeros(4, kv, 1, d, dtype=dtype)
    k_pad, v_pad = torch.cat([k_cache, pad], dim=2), torch.cat([v_cache, pad], dim=2)
    masked = L.attend(
        q, k_pad, v_pad, slots, positions, L.attention_mask(positions, t + 1, heads // kv), t + 1
    )
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 8e-3}
    torch.testing.assert_close(causal, masked, **tol)
