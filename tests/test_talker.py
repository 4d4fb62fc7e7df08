"""Talker, code predictor and Talker prompt construction against transformers' qwen3_omni_moe.

Weights are copied by name from a seeded reference model (tests/hf_fixtures.py), so these tests exercise
the module code only (the weight loader is tested with the parity test).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hf_fixtures import SMALL_CONFIGS, text_prompt
from transformers import DynamicCache

from omni_rt.errors import ConfigError, InvalidRequestError
from omni_rt.model.layers import KVCache
from omni_rt.model.talker import (
    Talker,
    talker_prompt,
    talker_prompt_last,
    talker_prompt_prefix,
    talker_step_input,
    talker_text_id,
)
from omni_rt.prompt_layout import user_turn_positions

NAME = "tiny"
CFG = SMALL_CONFIGS[NAME]
IDS = CFG.ids


@pytest.fixture(scope="module")
def ref(reference):
    return reference(NAME, 0)


@pytest.fixture(scope="module")
def talker(ref):
    t = Talker(CFG).eval()
    t.load_state_dict(ref.talker.state_dict(), strict=True)
    return t


def embed_fn(ref):
    return ref.thinker.get_input_embeddings()


def test_state_dict_names_and_shapes_match_checkpoint(ref):
    ours = {k: tuple(v.shape) for k, v in Talker(CFG).state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in ref.talker.state_dict().items()}
    assert ours == theirs


def test_bad_config_is_a_config_error():
    with pytest.raises(ConfigError):
        Talker(replace(CFG, code_predictor=replace(CFG.code_predictor, hidden_size=32, head_dim=8)))


@torch.no_grad()
def test_forward_matches_reference_prefill_then_decode(ref, talker):
    g = torch.Generator().manual_seed(1)
    b, t, h = 2, 7, CFG.talker.hidden_size
    x = torch.randn(b, t + 2, h, generator=g)  # [B, T+2, Ht]: a prefill of T, then two decode steps

    past = DynamicCache(config=ref.config.talker_config.text_config)
    want_logits, want_hidden = [], []
    for lo, hi in ((0, t), (t, t + 1), (t + 1, t + 2)):
        pos = torch.arange(lo, hi).expand(b, -1)  # [B, T] text positions (equal across t/h/w)
        out = ref.talker.model(
            inputs_embeds=x[:, lo:hi], position_ids=pos, past_key_values=past, use_cache=True
        )
        want_hidden.append(out.last_hidden_state)
        want_logits.append(ref.talker.codec_head(out.last_hidden_state))

    cache = talker.allocate_cache(n_slots=4, max_len=16)
    slots = torch.tensor([3, 1])  # arbitrary cache rows
    got_logits, got_hidden = [], []
    for lo, hi in ((0, t), (t, t + 1), (t + 1, t + 2)):
        pos = torch.arange(lo, hi).expand(b, -1)
        logits, hidden = talker(x[:, lo:hi], pos, cache, slots)
        got_logits.append(logits)
        got_hidden.append(hidden)

    # attending over a shorter static window (a kv_len bucket) changes nothing while it covers all positions
    cache2 = talker.allocate_cache(n_slots=4, max_len=16)
    talker(x[:, :t], torch.arange(t).expand(b, -1), cache2, slots, kv_len=8)
    logits, hidden = talker(x[:, t : t + 1], torch.full((b, 1), t), cache2, slots, kv_len=8)
    torch.testing.assert_close(logits, want_logits[1], atol=2e-5, rtol=1e-4)

    for got, want in zip(got_logits, want_logits, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for got, want in zip(got_hidden, want_hidden, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_forward_with_mrope_positions_matches_reference(ref, talker):
    """Image/video prompts give distinct (t, h, w) positions; the Talker rotates with all three."""
    g = torch.Generator().manual_seed(5)
    t, h = 6, CFG.talker.hidden_size
    x = torch.randn(1, t, h, generator=g)  # [1, T, Ht]
    thw = torch.tensor([[0, 1, 2, 2, 2, 3], [0, 1, 2, 2, 3, 4], [0, 1, 2, 3, 2, 5]])[:, None]  # [3, 1, T]
    out = ref.talker.model(inputs_embeds=x, position_ids=thw, use_cache=False)
    want = ref.talker.codec_head(out.last_hidden_state)
    cache = talker.allocate_cache(n_slots=1, max_len=8)
    logits, _ = talker(x, torch.arange(t)[None], cache, torch.tensor([0]), rope_positions=thw)
    torch.testing.assert_close(logits, want, atol=2e-5, rtol=1e-4)
    plain, _ = talker(x, torch.arange(t)[None], cache, torch.tensor([0]))
    assert not torch.allclose(plain, want, atol=1e-3)  # the (h, w) components really matter


@torch.no_grad()
def test_code_predictor_matches_reference_generate_greedy(ref, talker):
    g = torch.Generator().manual_seed(2)
    b, h = 3, CFG.talker.hidden_size
    hidden = torch.randn(b, h, generator=g)  # the Talker's last normed hidden: O(1) entries
    code0 = torch.tensor([5, 1777, 300])
    code0_embed = ref.talker.get_input_embeddings()(code0)  # [B, Ht]
    want = ref.talker.code_predictor.generate(
        inputs_embeds=torch.stack((hidden, code0_embed), dim=1),
        max_new_tokens=CFG.num_code_groups - 1,
        do_sample=False,
    )  # [B, 15]

    got = talker.code_predictor.predict(hidden, code0_embed)
    assert got.shape == (b, 15)
    assert torch.equal(got, want)
    assert len(set(got[0].tolist())) > 3, "codes barely vary: the comparison would be weak"

    frame = talker.predict_frame(hidden, code0)  # [B, 16]: code 0 then the predictor's 15
    assert torch.equal(frame[:, 0], code0) and torch.equal(frame[:, 1:], want)

    # a second frame reuses the predictor's static cache: stale rows must not leak into it
    again = talker.code_predictor.predict(hidden.flip(0), code0_embed.flip(0))
    assert torch.equal(again, want.flip(0))


@torch.no_grad()
def test_embed_codes_is_sum_of_group_embeddings(ref, talker):
    codes = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(3))
    want = ref.talker.get_input_embeddings()(codes[:, 0])
    for gi in range(15):
        want = want + ref.talker.code_predictor.get_input_embeddings()[gi](codes[:, gi + 1])
    torch.testing.assert_close(talker.embed_codes(codes), want, atol=1e-5, rtol=1e-5)


def _capture_talker_inputs(ref, prompt, max_tokens, eos=IDS.im_end):
    """Run the reference's generate up to the Talker call; return its Talker inputs and the text ids."""
    seen = {}

    class Stop(Exception):
        pass

    def spy(**kwargs):
        seen.update(kwargs)
        raise Stop

    ref.talker.generate = spy
    try:
        with pytest.raises(Stop):
            ref.generate(
                input_ids=torch.tensor([prompt]),
                speaker="ethan",
                return_audio=True,
                thinker_do_sample=False,
                talker_do_sample=False,
                thinker_max_new_tokens=max_tokens,
                thinker_eos_token_id=eos,
            )
    finally:
        del ref.talker.generate
    return seen


def _multi_turn_prompt():
    i = IDS
    return [
        *[i.im_start, i.system, i.newline, 2610, 525, 264, 10950, i.im_end, i.newline],
        *[i.im_start, i.user, i.newline, 9707, 0, i.im_end, i.newline],
        *[i.im_start, i.assistant, i.newline, 13048, 11, 1246, i.im_end, i.newline],
        *[i.im_start, i.user, i.newline, 3838, 374, 279, 9104, 30, i.im_end, i.newline],
        *[i.im_start, i.assistant, i.newline],
    ]


@pytest.mark.parametrize(
    "prompt",
    [
        [IDS.im_start, IDS.system, IDS.newline, 2610, 525, IDS.im_end, IDS.newline]
        + text_prompt(CFG, [9707, 11, 1879, 0]),
        _multi_turn_prompt(),
    ],
    ids=["system+user", "multi-turn"],
)
@torch.no_grad()
def test_prompt_equals_reference(ref, talker, prompt):
    seen = _capture_talker_inputs(ref, prompt, max_tokens=5)
    want = seen["inputs_embeds"][0]  # [L, Ht]
    assert seen["talker_input_ids"].shape[1] == want.shape[0]
    # the text the Thinker generated (greedy, so a rerun gives the same tokens)
    generated = ref.thinker.generate(input_ids=torch.tensor([prompt]), max_new_tokens=5, do_sample=False)[0]
    generated = generated[len(prompt) :].tolist()
    speaker = CFG.speaker_id("ethan")

    embed = embed_fn(ref)
    got = talker_prompt(talker, embed, prompt, speaker, generated[0])
    n_user = len(user_turn_positions(prompt, IDS.im_start, IDS.user))
    assert got.shape == want.shape == (n_user + 9, CFG.talker.hidden_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # the prefix is everything but the last position; the last needs only the first token's id
    prefix = talker_prompt_prefix(talker, embed, prompt, speaker)
    torch.testing.assert_close(prefix, want[:-1], atol=1e-5, rtol=1e-5)
    last = talker_prompt_last(talker, embed, torch.tensor([generated[0]]))
    torch.testing.assert_close(last[0], want[-1], atol=1e-5, rtol=1e-5)

    # trailing text: the reference drops the Thinker's last token when it stops at its token limit
    # (see talker_text_id); with that token dropped our text stream is the reference's, then tts_pad
    trailing, pad = seen["trailing_text_hidden"][0], seen["tts_pad_embed"][0, 0]
    codes = torch.zeros(1, 16, dtype=torch.long)
    zero_codes = talker.embed_codes(codes)
    for k in range(1, trailing.shape[0] + 3):
        tid = talker_text_id(generated[:-1], k, True, IDS)
        got_k = talker_step_input(talker, embed, codes, torch.tensor([tid]))[0] - zero_codes[0]
        want_k = trailing[k - 1] if k <= trailing.shape[0] else pad
        torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_trailing_text_ends_at_thinker_eos_like_reference(ref, talker):
    prompt = text_prompt(CFG, [9707, 11, 1879, 0])
    free = ref.thinker.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0]
    free = free[len(prompt) :].tolist()
    eos = free[4]  # declare the 5th greedy token the end of text: the Thinker then stops there
    assert eos not in free[:4], f"pick another prompt: {free}"
    ids = replace(IDS, im_end=eos)
    seen = _capture_talker_inputs(ref, prompt, max_tokens=8, eos=eos)
    trailing = seen["trailing_text_hidden"][0]  # tokens 1..3, then tts_eos
    assert trailing.shape[0] == 4

    embed = embed_fn(ref)
    generated = free[:5]  # what the Thinker emitted, EOS included
    for k in range(1, 7):
        tid = talker_text_id(generated, k, False, ids)  # not told it is done: EOS says so
        want = trailing[k - 1] if k <= 4 else seen["tts_pad_embed"][0, 0]
        torch.testing.assert_close(talker.project_text(embed(torch.tensor(tid))), want, atol=1e-5, rtol=1e-5)


def test_talker_text_id_stream():
    i = IDS
    toks = [10, 11, 12]
    assert [talker_text_id(toks, k, False, i) for k in (1, 2, 3)] == [11, 12, None]  # wait for token 3
    assert [talker_text_id(toks, k, True, i) for k in (1, 2, 3, 4, 5)] == [
        11,
        12,
        i.tts_eos,
        i.tts_pad,
        i.tts_pad,
    ]
    with_eos = [10, 11, i.im_end]
    assert [talker_text_id(with_eos, k, False, i) for k in (1, 2, 3)] == [11, i.tts_eos, i.tts_pad]
    assert talker_text_id(with_eos, 2, False, i, ignore_eos=True) == i.im_end
    with pytest.raises(ValueError):
        talker_text_id(toks, 0, True, i)


def test_prompt_must_end_with_assistant_header(ref, talker):
    bad = text_prompt(CFG, [9707])[:-1]
    with pytest.raises(InvalidRequestError, match="assistant header"):
        talker_prompt_prefix(talker, embed_fn(ref), bad, CFG.speaker_id("ethan"))
    audio_prompt = text_prompt(CFG, [IDS.audio_start, IDS.audio, IDS.audio, IDS.audio_end])
    with pytest.raises(InvalidRequestError, match="prompt_hidden"):
        talker_prompt_prefix(talker, embed_fn(ref), audio_prompt, CFG.speaker_id("ethan"))


@torch.no_grad()
def test_multimodal_positions_read_hidden_projection(ref, talker):
    prompt = text_prompt(CFG, [IDS.audio_start, IDS.audio, IDS.audio, IDS.audio_end, 9707])
    n = len(prompt)
    hidden = torch.randn(n, CFG.thinker.hidden_size, generator=torch.Generator().manual_seed(4))
    ids_t = torch.tensor([prompt])
    mm = (ids_t == IDS.audio) | (ids_t == IDS.image) | (ids_t == IDS.video)
    embeds = embed_fn(ref)(ids_t)
    user = user_turn_positions(prompt, IDS.im_start, IDS.user)
    want = ref._get_talker_user_parts(0, n, mm, hidden[None], embeds)[0][user]  # [U, Ht]
    got = talker_prompt_prefix(talker, embed_fn(ref), prompt, CFG.speaker_id("ethan"), prompt_hidden=hidden)
    torch.testing.assert_close(got[: want.shape[0]], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "case, match",
    [
        ("embeds_width", "inputs_embeds"),
        ("positions_shape", "positions must be"),
        ("position_beyond_cache", "positions must be in"),
        ("slot_beyond_cache", "slots must be in"),
        ("kv_len", "kv_len"),
        ("cache_of_other_model", "cache shape"),
    ],
)
def test_forward_bad_input_is_a_typed_error(talker, case, match):
    h = CFG.talker.hidden_size
    x, pos, slots = torch.zeros(1, 3, h), torch.arange(3)[None], torch.tensor([0])
    cache, kv_len = talker.allocate_cache(n_slots=2, max_len=8), None
    if case == "embeds_width":
        x = torch.zeros(1, 3, h + 1)
    elif case == "positions_shape":
        pos = torch.arange(4)[None]
    elif case == "position_beyond_cache":
        pos = torch.arange(6, 9)[None]
    elif case == "slot_beyond_cache":
        slots = torch.tensor([2])
    elif case == "kv_len":
        kv_len = 9
    elif case == "cache_of_other_model":
        cache = KVCache(1, 2, CFG.talker.num_key_value_heads, 8, CFG.talker.head_dim)
    with pytest.raises(InvalidRequestError, match=match):
        talker(x, pos, cache, slots, kv_len=kv_len)


def test_predict_bad_shapes_are_typed_errors(talker):
    h = CFG.talker.hidden_size
    with pytest.raises(InvalidRequestError, match="talker_hidden"):
        talker.code_predictor.predict(torch.zeros(2, h), torch.zeros(3, h))
    with pytest.raises(InvalidRequestError, match="code0"):
        talker.predict_frame(torch.zeros(2, h), torch.zeros(3, dtype=torch.long))
