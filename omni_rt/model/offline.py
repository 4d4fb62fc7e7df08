"""The offline generation loop: the readable truth the streaming pipeline is tested against.

    text_ids, codes, wav = generate_offline(model, input_ids, "ethan", thinker_sampling, talker_sampling,
                                            max_new_tokens=64, max_frames=256)
    ... = generate_offline(model, input_ids, ..., audio=[pcm_16k])    # a spoken last user turn

One sequence, no batching, no overlap between stages: the whole Thinker reply, then every Talker frame,
then one Code2Wav decode. Each stage runs the same module functions the pipeline runs.

How generation ends (the reference's rules, `Qwen3OmniMoeForConditionalGeneration.generate`):
- The Thinker stops at `<|im_end|>` (kept as the last text id, not spoken) or after `max_new_tokens`.
- The Talker reads the text one token per frame: its prefill ends with the first text token, decode step
  k reads text token k, then `tts_eos` once after the text, then `tts_pad` for as long as it keeps going
  (`talker.talker_text_id`). It stops when code 0 of a frame is codec EOS (that frame is not emitted)
  or after `max_frames` frames.
- One difference from the reference: when the Thinker stops at its token limit (no `<|im_end|>`), the
  reference never speaks the last generated token (it builds the Talker's text from the Thinker's input
  embeddings, which lack it); we speak every generated token. The reference with `max_new_tokens + 1`
  Thinker tokens therefore speaks exactly our text. If the first token is `<|im_end|>` there is no text,
  hence no audio (the reference would build a malformed Talker prompt).
- `ignore_eos` (benchmarks: fixed lengths): the Thinker runs to `max_new_tokens` (an `<|im_end|>` is
  plain text), and the Talker's codec EOS is suppressed, so it makes exactly `max_frames` frames.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from omni_rt.config import Sampling, StageSampling
from omni_rt.errors import InvalidRequestError
from omni_rt.model.sampling import (
    StageSampler,
    codec_suppress_ids,
    frame_sampler,
    residual_code_sampling,
)
from omni_rt.model.speech_input import thinker_input
from omni_rt.model.talker import (
    check_prompt,
    talker_prompt,
    talker_step_input,
    talker_text_id,
)


def _prompt_tensor(input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(input_ids, dtype=torch.long)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.numel() == 0:
        raise InvalidRequestError(f"input_ids must be one non-empty sequence [T], got shape {tuple(t.shape)}")
    return t


@torch.no_grad()
def generate_offline(
    model,
    input_ids: Sequence[int] | torch.Tensor,
    voice: str,
    thinker_sampling: StageSampling,
    talker_sampling: StageSampling,
    max_new_tokens: int,
    max_frames: int,
    ignore_eos: bool = False,
    *,
    audio: Sequence[np.ndarray | torch.Tensor] | None = None,
    inputs_embeds: torch.Tensor | None = None,
    code_predictor_sampling: StageSampling | None = None,
    seed: int | None = None,
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Generate one reply: (text ids, codes [16, N] (int64, CPU), wav float32 [S] (CPU)).

    `model` has `.thinker`, `.talker`, `.code2wav` (an `OmniModel`). `input_ids` is a chat prompt ending
    with `<|im_start|> assistant \\n`. Text ids include the final `<|im_end|>` when the Thinker emits it.
    Speech input (`speech_input.thinker_input`): `audio` holds the 16 kHz mono clips of the LAST user
    turn, encoded by `model.thinker.audio_tower`; the prompt either has no audio segments (the clips go
    at the start of that turn) or one per clip there, in template form (one `<|audio_pad|>`) or expanded.
    Or `inputs_embeds` [T, H] holds precomputed Thinker input embeddings of exactly `input_ids`.
    Placeholders with neither are an `InvalidRequestError`.
    The code predictor samples with `code_predictor_sampling` (default: `Sampling().code_predictor`, the
    reference's top-k 50, top-p 0.8) when the Talker samples, and is greedy when the Talker is greedy.
    Draws are keyed by (`seed`, stage, position) as in the streaming pipeline (model/sampling.py), so a
    seeded reply here equals the pipeline's; None: a fresh seed.
    """
    thinker, talker, code2wav = model.thinker, model.talker, model.code2wav
    cfg = talker.cfg
    ids = cfg.ids
    device = talker.codec_head.weight.device
    prompt = _prompt_tensor(input_ids)  # [P]
    check_prompt(prompt, ids)
    if max_new_tokens < 1 or max_frames < 1:
        raise InvalidRequestError(
            f"max_new_tokens ({max_new_tokens}) and max_frames ({max_frames}) must be >= 1"
        )
    try:
        speaker = cfg.speaker_id(voice)
    except KeyError as e:
        raise InvalidRequestError(str(e.args[0])) from None
    encoder = getattr(thinker, "audio_tower", None)
    x = thinker_input(thinker, encoder, prompt, ids, audio=audio, inputs_embeds=inputs_embeds)
    prompt = x.input_ids[0]  # [P]: with the clips' placeholders when audio was given
    vocab_text = thinker.cfg.vocab_size
    slot = torch.zeros(1, dtype=torch.long, device=device)  # one sequence: cache row 0

    # 1. Thinker: prefill the prompt, then one token per step.
    p = prompt.shape[0]
    cache = thinker.allocate_cache(1, p + max_new_tokens)
    # the Talker reads hidden_states[accept_hidden_layer] at the placeholders; positions of text and
    # audio prompts are 0..P-1 in all three M-RoPE components, so no rope_positions (speech_input.py)
    hidden_layer = cfg.accept_hidden_layer if bool(x.mm_mask.any()) else None
    seed = Sampling(seed=seed).response_seed()
    pick_text = StageSampler("thinker", 1, vocab_text, device)
    # the reference's repetition penalty covers the prompt too
    pick_text.assign(0, thinker_sampling, seed, history_ids=prompt)
    logits, prompt_hidden = thinker(
        None, x.positions, cache, slot, hidden_layer, last_only=True, inputs_embeds=x.inputs_embeds
    )
    text: list[int] = []
    while True:
        # a draw is keyed by the position the chosen token takes (as in the pipeline)
        tok = pick_text(logits[:, -1], slot, torch.tensor([p + len(text)], device=device))  # [1]
        text.append(int(tok))
        if len(text) == max_new_tokens or (text[-1] == ids.im_end and not ignore_eos):
            break
        pos = torch.full((1, 1), p + len(text) - 1, device=device)
        logits, _ = thinker(tok[None], pos, cache, slot, last_only=True)
    if text[0] == ids.im_end and not ignore_eos:  # nothing to say
        return text, torch.zeros(cfg.num_code_groups, 0, dtype=torch.long), torch.zeros(0)

    # 2. Talker: prefill (user turns, assistant header, first text token), then one frame per step.
    embed_text = thinker.embed
    x = talker_prompt(talker, embed_text, prompt, speaker, text[0], prompt_hidden=_first(prompt_hidden))
    n = x.shape[0]
    tcache = talker.allocate_cache(1, n + max_frames)
    vocab = cfg.talker.vocab_size
    fused = getattr(model, "fused_sampling", False)  # as the pipeline's samplers (engine.apply_kernels)
    supp = codec_suppress_ids(vocab, ids.codec_eos)
    pick_code0 = StageSampler("talker", 1, vocab, device, suppress=supp, fused=fused)
    pick_code0.assign(0, talker_sampling, seed, suppress_extra=[ids.codec_eos] if ignore_eos else ())
    # the reference's code predictor follows the Talker: greedy when the Talker is greedy
    whole = Sampling(thinker=thinker_sampling, talker=talker_sampling)
    if code_predictor_sampling is not None:
        whole = whole.model_copy(update={"code_predictor": code_predictor_sampling})
    pick_rest = StageSampler(
        "code_predictor", 1, cfg.code_predictor.vocab_size, device, history=False, fused=fused
    )
    pick_rest.assign(0, residual_code_sampling(whole.effective_code_predictor), seed)
    logits, hidden = talker(x[None], torch.arange(n, device=device)[None], tcache, slot)
    # Talker draws are keyed by the position of the step that made the logits; a frame's residual
    # codes by that position too (frame_sampler adds the code group)
    key = torch.tensor([n - 1], device=device)
    code0 = pick_code0(logits[:, -1], slot, key)  # [1]
    frames: list[torch.Tensor] = []
    while int(code0) != ids.codec_eos:
        codes = talker.predict_frame(hidden[:, -1], code0, frame_sampler(pick_rest, slot, key))  # [1, 16]
        frames.append(codes[0])
        k = len(frames)  # the next Talker step reads text token k
        if k == max_frames:
            break
        text_id = talker_text_id(text, k, True, ids, ignore_eos)
        step = talker_step_input(talker, embed_text, codes, torch.tensor([text_id], device=device))  # [1, Ht]
        key = torch.tensor([n - 1 + k], device=device)
        logits, hidden = talker(step[:, None], key[:, None], tcache, slot)
        code0 = pick_code0(logits[:, -1], slot, key)
    if not frames:
        return text, torch.zeros(cfg.num_code_groups, 0, dtype=torch.long), torch.zeros(0)
    codes = torch.stack(frames, dim=1)  # [16, N]

    # 3. Code2Wav: one offline decode of all frames.
    wav = code2wav(codes[None])  # [1, 1, S]
    return text, codes.cpu(), wav.reshape(-1).float().cpu()


def _first(hidden: torch.Tensor | None) -> torch.Tensor | None:
    return None if hidden is None else hidden[0]
