"""End-to-end parity with the reference: identical text ids, identical codec frames, the same waveform.

Small random Qwen3-Omni checkpoints (tests/hf_fixtures.py: seeded fan-in init, so routing, attention and
positions all matter) are saved with transformers' `save_pretrained`, loaded with omni_rt's loader and run
through `generate_offline` in greedy mode; the reference runs `Qwen3OmniMoeForConditionalGeneration
.generate(..., thinker_do_sample=False, talker_do_sample=False)` (its code predictor follows the Talker's
do_sample, so it is greedy too), with the Talker's repetition penalty 1.05 and suppressed codec specials.

Off-by-ones of the reference (see omni_rt/model/offline.py): with `talker_max_new_tokens = F + 1` it makes
at most F frames (the last code 0 gets no residual codes), and with `thinker_max_new_tokens = N + 1` and no
`<|im_end|>` it speaks the first N tokens, which is what we speak of N tokens.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hf_fixtures import SMALL_CONFIGS, text_prompt

from omni_rt.config import Sampling
from omni_rt.errors import InvalidRequestError
from omni_rt.model.config import OmniConfig
from omni_rt.model.offline import generate_offline
from omni_rt.model.omni import OmniModel

MAX_TOKENS = 8
MAX_FRAMES = 8
MIN_FRAMES = 4


def build(cfg: OmniConfig, ckpt) -> OmniModel:
    return OmniModel.build(cfg, device="cpu", dtype=torch.float32, weights=ckpt)


def multi_turn(cfg: OmniConfig) -> list[int]:
    i = cfg.ids
    return [
        *[i.im_start, i.system, i.newline, 2610, 525, 264, 10950, 17847, i.im_end, i.newline],
        *[i.im_start, i.user, i.newline, 9707, 0, i.im_end, i.newline],
        *[i.im_start, i.assistant, i.newline, 13048, 11, 1246, 646, i.im_end, i.newline],
        *[i.im_start, i.user, i.newline, 3838, 374, 279, 9104, 30, i.im_end, i.newline],
        *[i.im_start, i.assistant, i.newline],
    ]


def single_turn(cfg: OmniConfig) -> list[int]:
    return text_prompt(cfg, [9707, 11, 1879, 0, 2585, 525, 498, 30])


@torch.no_grad()
def reference_generate(
    ref,
    prompt: list[int],
    max_tokens: int,
    max_frames: int,
    eos: int,
    codec_eos: int | None = None,
    talker_penalty: float = 1.05,
    **inputs,
):
    """The reference's greedy generate with audio: (new text ids, codes [16, frames], wav [S]).

    `inputs`: more model inputs for `generate` (speech: input_features, feature_attention_mask)."""
    talker_out = {}
    orig = ref.talker.generate

    def capture(*args, **kwargs):  # its frames are the residual codes recorded at each Talker step
        talker_out["out"] = orig(*args, **kwargs)
        return talker_out["out"]

    ref.talker.generate = capture
    try:
        seqs, wav = ref.generate(
            input_ids=torch.tensor([prompt]),
            speaker="ethan",
            return_audio=True,
            thinker_do_sample=False,
            talker_do_sample=False,
            thinker_max_new_tokens=max_tokens,
            thinker_eos_token_id=eos,
            talker_max_new_tokens=max_frames,
            talker_repetition_penalty=talker_penalty,
            **({} if codec_eos is None else {"talker_eos_token_id": codec_eos}),
            **inputs,
        )
    finally:
        del ref.talker.generate
    steps = talker_out["out"].hidden_states
    codes = torch.stack([h[-1][0] for h in steps if h[-1] is not None], dim=1)  # [16, frames]
    return seqs[0, len(prompt) :].tolist(), codes, wav.reshape(-1)


def run_both(ref, ours, cfg: OmniConfig, prompt: list[int], eos=None, codec_eos=None, talker_penalty=1.05):
    greedy = Sampling.greedy()
    talker = greedy.talker.model_copy(update={"repetition_penalty": talker_penalty})
    text, codes, wav = generate_offline(
        ours, prompt, "ethan", greedy.thinker, talker, max_new_tokens=MAX_TOKENS, max_frames=MAX_FRAMES
    )
    eos = cfg.ids.im_end if eos is None else eos
    ref_text, ref_codes, ref_wav = reference_generate(
        ref, prompt, MAX_TOKENS + 1, MAX_FRAMES + 1, eos, codec_eos, talker_penalty
    )
    return (text, codes, wav), (ref_text, ref_codes, ref_wav)


def assert_parity(ours, theirs, stopped_at_eos: bool, min_frames: int = MIN_FRAMES):
    (text, codes, wav), (ref_text, ref_codes, ref_wav) = ours, theirs
    if stopped_at_eos:
        assert text == ref_text
    else:
        assert len(text) == MAX_TOKENS and text == ref_text[:MAX_TOKENS]
    assert len(set(text)) > 2, f"Thinker output barely varies: {text}"
    assert codes.shape[0] == 16 and codes.shape[1] >= min_frames, f"only {codes.shape[1]} frames"
    assert codes.shape == ref_codes.shape and torch.equal(codes, ref_codes), (codes, ref_codes)
    assert wav.dtype == torch.float32 and wav.shape == ref_wav.shape
    torch.testing.assert_close(wav, ref_wav.float(), atol=1e-4, rtol=0)
    assert wav.abs().max() > 1e-2  # a real waveform, not silence


CASES = [("wide", 0), ("deep", 0), ("narrow", 0)]  # "tiny" runs in the EOS cases below


@pytest.mark.parametrize("name,seed", CASES)
@pytest.mark.parametrize("turns", ["single", "multi"])
def test_greedy_parity(reference, checkpoint, name, seed, turns):
    cfg = SMALL_CONFIGS[name]
    ref = reference(name, seed)
    ours = build(cfg, checkpoint(name, seed))
    prompt = single_turn(cfg) if turns == "single" else multi_turn(cfg)
    assert_parity(*run_both(ref, ours, cfg, prompt), stopped_at_eos=False)


def test_greedy_parity_with_a_repetition_penalty_that_changes_codes(reference, checkpoint):
    """At 1.05 the penalty flips no greedy choice of these random Talkers; at 1.3 it does for "deep"
    (code 0 repeats there), so this case checks that it is applied as the reference applies it."""
    name = "deep"
    cfg = SMALL_CONFIGS[name]
    ref, ours = reference(name, 0), build(cfg, checkpoint(name, 0))
    prompt = multi_turn(cfg)
    greedy = Sampling.greedy()  # the reference's default penalty, 1.05
    _, default_codes, _ = generate_offline(
        ours, prompt, "ethan", greedy.thinker, greedy.talker, MAX_TOKENS, MAX_FRAMES
    )
    penalised, theirs = run_both(ref, ours, cfg, prompt, talker_penalty=1.3)
    assert not torch.equal(penalised[1], default_codes)
    assert_parity(penalised, theirs, stopped_at_eos=False)


def test_greedy_parity_when_thinker_stops_at_eos(reference, checkpoint):
    """The Thinker ends its text itself: declare its 5th greedy token the EOS id, in both models."""
    name = "tiny"
    cfg = SMALL_CONFIGS[name]
    ref = reference(name, 0)
    prompt = single_turn(cfg)
    (free, _, _), _ = run_both(ref, build(cfg, checkpoint(name, 0)), cfg, prompt)
    eos = free[4]
    assert eos not in free[:4]
    cfg_eos = replace(cfg, ids=replace(cfg.ids, im_end=eos))
    ours, theirs = run_both(ref, build(cfg_eos, checkpoint(name, 0)), cfg_eos, prompt, eos=eos)
    assert ours[0] == free[:5]
    assert_parity(ours, theirs, stopped_at_eos=True)


def test_greedy_parity_when_talker_stops_at_codec_eos(reference, checkpoint):
    """The Talker ends the audio itself: declare its 6th greedy code 0 the codec EOS id, in both models."""
    name = "wide"
    cfg = SMALL_CONFIGS[name]
    ref = reference(name, 0)
    prompt = multi_turn(cfg)
    (_, free, _), _ = run_both(ref, build(cfg, checkpoint(name, 0)), cfg, prompt)
    codec_eos = int(free[0, 5])
    assert codec_eos not in free[0, :5].tolist()
    cfg_eos = replace(cfg, ids=replace(cfg.ids, codec_eos=codec_eos))
    ours, theirs = run_both(ref, build(cfg_eos, checkpoint(name, 0)), cfg_eos, prompt, codec_eos=codec_eos)
    assert ours[1].shape[1] == 5  # the EOS frame itself is not emitted
    assert torch.equal(ours[1], free[:, :5])
    assert_parity(ours, theirs, stopped_at_eos=False, min_frames=5)


def test_ignore_eos_runs_both_stages_to_their_limits(checkpoint):
    """Benchmarks: with ignore_eos neither the Thinker's EOS nor the codec EOS ends generation."""
    cfg = SMALL_CONFIGS["tiny"]
    greedy = Sampling.greedy()
    prompt = single_turn(cfg)
    free_text, free_codes, _ = generate_offline(
        build(cfg, checkpoint("tiny", 0)), prompt, "ethan", greedy.thinker, greedy.talker, 8, 8
    )
    ids = replace(cfg.ids, im_end=free_text[2], codec_eos=int(free_codes[0, 2]))
    model = build(replace(cfg, ids=ids), checkpoint("tiny", 0))
    text, codes, wav = generate_offline(model, prompt, "ethan", greedy.thinker, greedy.talker, 8, 8)
    assert text == free_text[:3] and codes.shape[1] <= 2  # both EOS ids end generation early
    text, codes, wav = generate_offline(
        model, prompt, "ethan", greedy.thinker, greedy.talker, 8, 8, ignore_eos=True
    )
    assert text == free_text and codes.shape == (16, 8)  # EOS ids are plain text / never chosen
    assert wav.shape == (model.code2wav.output_length(8),)


def test_no_text_means_no_audio(checkpoint):
    """A reply that is only `<|im_end|>` has nothing to speak (the reference would build a broken prompt)."""
    cfg = SMALL_CONFIGS["tiny"]
    greedy = Sampling.greedy()
    prompt = single_turn(cfg)
    free_text, _, _ = generate_offline(
        build(cfg, checkpoint("tiny", 0)), prompt, "ethan", greedy.thinker, greedy.talker, 2, 2
    )
    model = build(replace(cfg, ids=replace(cfg.ids, im_end=free_text[0])), checkpoint("tiny", 0))
    text, codes, wav = generate_offline(model, prompt, "ethan", greedy.thinker, greedy.talker, 8, 8)
    assert text == free_text[:1] and codes.shape == (16, 0) and wav.shape == (0,)


def test_sampling_is_seeded_and_valid(checkpoint):
    cfg = SMALL_CONFIGS["narrow"]
    model = build(cfg, checkpoint("narrow", 0))
    s = (
        Sampling()
    )  # the reference's defaults: Talker temperature 0.9, top-k 50; predictor top-k 50, top-p 0.8
    prompt = single_turn(cfg)

    def run(seed):
        return generate_offline(model, prompt, "chelsie", s.thinker, s.talker, 6, 6, seed=seed)

    a, b, c = run(7), run(7), run(8)
    assert a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert a[0] != c[0] or not torch.equal(a[1], c[1])
    codes = a[1]
    assert codes.min() >= 0 and codes.max() < cfg.code2wav.codebook_size


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(voice="nobody"), "unknown voice"),
        (dict(input_ids=[1, 2, 3]), "assistant header"),
        (dict(input_ids=[]), "non-empty"),
        (dict(max_frames=0), "max_frames"),
        (dict(input_ids=[10**7, 151644, 77091, 198]), "token ids"),
        # an audio placeholder with nothing to fill it, a clip too short for one mel frame, embeddings
        # that do not fit the prompt
        (
            dict(input_ids=[151644, 872, 198, 151669, 151675, 151670, 151645, 198, 151644, 77091, 198]),
            "no audio",
        ),
        (dict(audio=[np.zeros(100, dtype=np.float32)]), "at least 400"),
        (dict(inputs_embeds=torch.zeros(3, 4)), "inputs_embeds must be"),
    ],
)
def test_bad_input_is_a_typed_error(checkpoint, change, match):
    cfg = SMALL_CONFIGS["tiny"]
    greedy = Sampling.greedy()
    kwargs = dict(
        model=build(cfg, checkpoint("tiny", 0)),
        input_ids=single_turn(cfg),
        voice="ethan",
        thinker_sampling=greedy.thinker,
        talker_sampling=greedy.talker,
        max_new_tokens=4,
        max_frames=4,
    )
    with pytest.raises(InvalidRequestError, match=match):
        generate_offline(**(kwargs | change))
