"""Speech input end to end: prompt layout, M-RoPE positions, Thinker logits and greedy replies equal the
reference's (transformers' qwen3_omni_moe fed `input_features` + `feature_attention_mask`).

The reply test runs omni_rt's `generate_offline(..., audio=[clip])` against the reference's
`generate(..., input_features=..., feature_attention_mask=..., return_audio=True)`. Off-by-ones of the
reference as in tests/test_parity.py: it gets one more Thinker token and one more Talker step than we
do, and then speaks exactly what we speak.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_fixtures import SMALL_CONFIGS
from test_parity import MAX_FRAMES, MAX_TOKENS, assert_parity, reference_generate

from omni_rt.audio.features import audio_token_count, log_mel
from omni_rt.config import Sampling
from omni_rt.errors import InvalidRequestError
from omni_rt.model.config import TokenIds
from omni_rt.model.offline import generate_offline
from omni_rt.model.omni import OmniModel
from omni_rt.model.speech_input import (
    audio_spans,
    build_speech_input,
    expand_audio_placeholders,
    mrope_positions,
    multimodal_mask,
    place_audio,
    scatter_audio,
    speech_prompt,
    speech_turn_input,
    thinker_input,
)

IDS = TokenIds()
QUESTION = [3838, 374, 419, 30]  # "What is this?"


def speech(seconds: float, seed: int) -> np.ndarray:
    """A voiced-ish test signal: two harmonics with a wobble, plus noise, at 16 kHz."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    f0 = 140 + 30 * np.sin(2 * np.pi * 3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / 16000
    x = 0.3 * np.sin(phase) + 0.15 * np.sin(3 * phase) + 0.02 * rng.standard_normal(t.shape)
    return x.astype(np.float32)


def reference_features(clips: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """The processor's feature extractor: (input_features [B, 128, T], feature_attention_mask [B, T])."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400)
    out = fe(
        clips if len(clips) > 1 else clips[0],
        sampling_rate=16000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    return out["input_features"], out["attention_mask"]


# ---------------------------------------------------------------------------------------------------------
# prompt layout and positions


def test_speech_prompt_layout():
    p = speech_prompt(IDS, [3, 2], text_ids=[7, 8], history=[IDS.im_start, IDS.system, IDS.newline, 5])
    a, s, e = IDS.audio, IDS.audio_start, IDS.audio_end
    assert p == [
        *[IDS.im_start, IDS.system, IDS.newline, 5],
        *[IDS.im_start, IDS.user, IDS.newline, s, a, a, a, e, s, a, a, e, 7, 8, IDS.im_end, IDS.newline],
        *[IDS.im_start, IDS.assistant, IDS.newline],
    ]
    assert audio_spans(p, IDS) == [(8, 11), (13, 15)]
    assert multimodal_mask(p, IDS).nonzero().flatten().tolist() == [8, 9, 10, 13, 14]
    template = speech_prompt(IDS, [1, 1], text_ids=[7, 8])
    assert expand_audio_placeholders(template, [3, 2], IDS) == speech_prompt(IDS, [3, 2], text_ids=[7, 8])


def test_place_audio_puts_clips_in_the_last_user_turn():
    history = [IDS.im_start, IDS.user, IDS.newline, 5, IDS.im_end, IDS.newline]
    history += [IDS.im_start, IDS.assistant, IDS.newline, 6, IDS.im_end, IDS.newline]
    want = speech_prompt(IDS, [3, 2], text_ids=[7, 8], history=history)
    text_only = speech_prompt(IDS, [1], text_ids=[7, 8], history=history)
    text_only = [t for t in text_only if t not in (IDS.audio_start, IDS.audio, IDS.audio_end)]
    template = speech_prompt(IDS, [1, 1], text_ids=[7, 8], history=history)
    # no segments: inserted before the turn's text; template form: expanded; model form: kept
    for prompt in (text_only, template, want):
        assert place_audio(prompt, [3, 2], IDS) == want
    with pytest.raises(InvalidRequestError, match="already has 3"):
        place_audio(want, [4, 2], IDS)
    with pytest.raises(InvalidRequestError, match="2 audio segments, 1 clips"):
        place_audio(want, [3], IDS)
    # a segment in an earlier turn has no clip to fill it
    earlier = speech_prompt(IDS, [2], text_ids=[5])[:-3] + history[6:] + text_only[len(history) :]
    with pytest.raises(InvalidRequestError, match="outside the last user turn"):
        place_audio(earlier, [2], IDS)
    with pytest.raises(InvalidRequestError, match="no user turn"):
        place_audio([IDS.im_start, IDS.assistant, IDS.newline], [2], IDS)


@pytest.mark.parametrize(
    "bad",
    [
        [IDS.audio, 1, 2],  # placeholder outside a segment
        [IDS.audio_start, IDS.audio_end],  # empty segment
        [IDS.audio_start, IDS.audio, IDS.audio, 5],  # unterminated
    ],
)
def test_malformed_segments_are_typed_errors(bad):
    with pytest.raises(InvalidRequestError):
        audio_spans(bad, IDS)


def test_counts_must_match_features():
    p = speech_prompt(IDS, [int(audio_token_count(150))])
    assert mrope_positions(p, IDS, [150]).shape == (3, 1, len(p))
    with pytest.raises(InvalidRequestError, match="33 encoder tokens, but its segment has 20"):
        mrope_positions(p, IDS, [151 + 100])
    with pytest.raises(InvalidRequestError, match="1 audio segments"):
        mrope_positions(p, IDS, [150, 150])
    assert expand_audio_placeholders(p, [20], IDS) == p  # already expanded: kept
    with pytest.raises(InvalidRequestError, match="already has 20"):
        expand_audio_placeholders(p, [21], IDS)
    with pytest.raises(InvalidRequestError):
        scatter_audio(torch.zeros(len(p), 4), p, torch.zeros(19, 4), IDS)


@pytest.mark.parametrize("lens", [[150], [37, 420], [100, 1, 999]])
def test_positions_equal_reference_get_rope_index(reference, lens):
    thinker = reference("tiny").thinker
    history = [IDS.im_start, IDS.system, IDS.newline, 11, 12, IDS.im_end, IDS.newline]
    p = speech_prompt(IDS, [int(audio_token_count(n)) for n in lens], text_ids=[5, 6, 7], history=history)
    ids = torch.tensor([p])
    ours = mrope_positions(p, IDS, lens)
    # the reference's segment walk (taken only when a grid is passed; an empty one adds no images) ...
    ref, delta = thinker.get_rope_index(
        ids, image_grid_thw=torch.zeros(0, 3, dtype=torch.long), attention_mask=torch.ones_like(ids),
        audio_seqlens=torch.tensor(lens),
    )  # fmt: skip
    assert torch.equal(ours, ref.long()) and int(delta) == 0
    # ... and the path it takes for audio-only prompts, sequential positions: the same
    ref_plain, _ = thinker.get_rope_index(
        ids, attention_mask=torch.ones_like(ids), audio_seqlens=torch.tensor(lens)
    )
    assert torch.equal(ours, ref_plain.long())
    assert torch.equal(ours[0, 0], torch.arange(len(p)))


# ---------------------------------------------------------------------------------------------------------
# against the reference model


@pytest.fixture(scope="module")
def built(checkpoint):
    """name -> OmniModel (its audio encoder at `thinker.audio_tower`) loaded from the saved reference checkpoint."""
    cache = {}

    def get(name: str):
        if name not in cache:
            ckpt = checkpoint(name)
            cache[name] = OmniModel.build(
                SMALL_CONFIGS[name], device="cpu", dtype=torch.float32, weights=ckpt
            )
        return cache[name]

    return get


@pytest.mark.parametrize("name", ["tiny", "deep"])
@torch.no_grad()
def test_thinker_logits_with_two_clips_equal_reference(reference, built, name):
    cfg = SMALL_CONFIGS[name]
    ref = reference(name)
    model = built(name)
    enc = model.thinker.audio_tower
    clips = [speech(1.3, 1), speech(0.45, 2)]  # 130 and 45 mel frames: 13 + 2 and 6 tokens
    feats, fmask = reference_features(clips)
    lens = fmask.sum(-1).tolist()
    prompt = speech_prompt(cfg.ids, [int(audio_token_count(n)) for n in lens], text_ids=QUESTION)
    ids = torch.tensor([prompt])
    out = ref.thinker(
        input_ids=ids,
        input_features=feats,
        feature_attention_mask=fmask,
        attention_mask=torch.ones_like(ids),
        output_hidden_states=True,
    )
    # ours: features per clip (each clip's frames of the batch; the padded tail of the short clip is the
    # reference's own batching artefact, so take its features from the batch, as the processor made them)
    x = build_speech_input(model.thinker, enc, prompt, [feats[i, :, :n] for i, n in enumerate(lens)], cfg.ids)
    t = len(prompt)
    cache = model.thinker.allocate_cache(1, t)
    logits, hidden = model.thinker(
        None, x.positions, cache, torch.zeros(1, dtype=torch.long), cfg.accept_hidden_layer,
        inputs_embeds=x.inputs_embeds, rope_positions=x.rope_positions,
    )  # fmt: skip
    torch.testing.assert_close(logits, out.logits, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(hidden, out.hidden_states[cfg.accept_hidden_layer], atol=1e-4, rtol=1e-4)
    # the audio matters: without it (placeholder embeddings) the logits differ
    plain, _ = model.thinker(torch.tensor([prompt]), x.positions, cache, torch.zeros(1, dtype=torch.long))
    assert not torch.allclose(plain, logits, atol=1e-2)


def test_single_clip_features_from_log_mel_match_processor():
    clip = speech(1.0, 3)
    feats, mask = reference_features([clip])
    torch.testing.assert_close(log_mel(clip), feats[0], atol=1e-4, rtol=0)
    assert int(mask.sum()) == log_mel(clip).shape[1]


@pytest.mark.parametrize("name", ["tiny", "deep"])
def test_greedy_reply_to_speech_equals_reference(reference, built, name):
    cfg = SMALL_CONFIGS[name]
    ref = reference(name)
    model = built(name)
    enc = model.thinker.audio_tower
    clip = speech(1.6, 4)
    feats, fmask = reference_features([clip])
    n_frames = int(fmask.sum())
    prompt = speech_prompt(cfg.ids, [int(audio_token_count(n_frames))], text_ids=QUESTION)
    x = build_speech_input(model.thinker, enc, prompt, [log_mel(clip)], cfg.ids)
    assert x.mm_mask.sum() == audio_token_count(n_frames) == 13 + 8  # 160 frames
    # the one-call path from raw PCM builds the same inputs
    pcm = np.round(clip * 32767).astype(np.int16)
    same = speech_turn_input(
        model.thinker, enc, [pcm.astype(np.float32) / 32768.0], cfg.ids, text_ids=QUESTION
    )
    assert torch.equal(same.input_ids[0], torch.tensor(prompt))
    torch.testing.assert_close(same.inputs_embeds, x.inputs_embeds, atol=1e-3, rtol=0)
    torch.testing.assert_close(
        speech_turn_input(model.thinker, enc, [pcm], cfg.ids, text_ids=QUESTION).inputs_embeds,
        same.inputs_embeds,
    )

    greedy = Sampling.greedy()
    text, codes, wav = generate_offline(
        model, prompt, "ethan", greedy.thinker, greedy.talker, MAX_TOKENS, MAX_FRAMES, audio=[clip]
    )
    ids = torch.tensor([prompt])
    theirs = reference_generate(
        ref, prompt, MAX_TOKENS + 1, MAX_FRAMES + 1, cfg.ids.im_end,
        input_features=feats, feature_attention_mask=fmask, attention_mask=torch.ones_like(ids),
    )  # fmt: skip
    assert_parity((text, codes, wav), theirs, cfg.ids.im_end in text, min_frames=3)

    # the Talker heard the audio through hidden_projection: different audio, different frames or text
    text2, codes2, _ = generate_offline(
        model, prompt, "ethan", greedy.thinker, greedy.talker, MAX_TOKENS, MAX_FRAMES,
        audio=[speech(1.6, 99) * 0.2],
    )  # fmt: skip
    assert text2 != text or not torch.equal(codes2, codes)


@torch.no_grad()
def test_every_way_to_give_the_audio_makes_the_same_reply(built):
    """audio= with the prompt in model form, template form or without segments, and inputs_embeds=."""
    cfg = SMALL_CONFIGS["tiny"]
    model = built("tiny")
    clip = speech(0.9, 5)
    n = int(audio_token_count(log_mel(clip).shape[1]))
    greedy = Sampling.greedy()

    def reply(prompt, **kw):
        return generate_offline(model, prompt, "ethan", greedy.thinker, greedy.talker, 4, 4, **kw)

    want_text, want_codes, want_wav = reply(speech_prompt(cfg.ids, [n], text_ids=QUESTION), audio=[clip])
    template = speech_prompt(cfg.ids, [1], text_ids=QUESTION)
    no_segment = [t for t in template if t not in (cfg.ids.audio_start, cfg.ids.audio, cfg.ids.audio_end)]
    x = thinker_input(model.thinker, model.thinker.audio_tower, no_segment, cfg.ids, audio=[clip])
    for prompt, kw in (
        (template, {"audio": [clip]}),
        (no_segment, {"audio": [torch.from_numpy(clip)]}),
        (x.input_ids[0], {"inputs_embeds": x.inputs_embeds[0]}),
    ):
        text, codes, wav = reply(prompt, **kw)
        assert text == want_text and torch.equal(codes, want_codes) and torch.equal(wav, want_wav)


def test_placeholders_need_their_audio(built):
    cfg = SMALL_CONFIGS["tiny"]
    model = built("tiny")
    greedy = Sampling.greedy()
    prompt = speech_prompt(cfg.ids, [5], text_ids=QUESTION)

    def reply(prompt, **kw):
        return generate_offline(model, prompt, "ethan", greedy.thinker, greedy.talker, 2, 2, **kw)

    with pytest.raises(InvalidRequestError, match="5 <\\|audio_pad\\|> placeholders but no audio"):
        reply(prompt)
    with pytest.raises(InvalidRequestError, match="not both"):
        reply(prompt, audio=[speech(0.3, 1)], inputs_embeds=torch.zeros(len(prompt), 64))
    with pytest.raises(InvalidRequestError, match="makes 4 encoder tokens"):
        reply(prompt, audio=[speech(0.3, 1)])  # 30 frames: 4 tokens, not 5
    with pytest.raises(InvalidRequestError, match="a list of clips"):
        reply(prompt, audio=speech(0.3, 1))
    with pytest.raises(InvalidRequestError, match=r"inputs_embeds must be \[T, H\]"):
        reply(prompt, inputs_embeds=torch.zeros(len(prompt) - 1, 64))
    image = [cfg.ids.im_start, cfg.ids.user, cfg.ids.newline, cfg.ids.image, *prompt[-6:]]
    with pytest.raises(InvalidRequestError, match="image/video"):
        reply(image)
