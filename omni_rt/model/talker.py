"""The Talker: a codec LLM that reads the Thinker's text and speaks it as 16-group codec frames.

One frame (80 ms of audio) per step:
  1. the Talker (MoE decoder) predicts code 0 of the frame from its input embedding;
  2. the code predictor (a small dense decoder with its own 16-position cache) predicts codes 1..15,
     one at a time, from the Talker's last hidden state and the embedding of code 0;
  3. the next Talker input is the sum of the frame's 16 code embeddings plus the projected embedding of
     the next text token (then `tts_eos` once after the text, then `tts_pad`).

Parameter names are the checkpoint's names under `talker.`; experts packed as in docs/internals.md.

Prompt construction lives here as plain functions shared by the offline loop (`offline.py`) and the
streaming pipeline. For a text prompt with user turns U (every token of every user turn, from its
`<|im_start|>` through the `\\n` after its `<|im_end|>`; system and assistant turns dropped) and the
first generated text token t0, the Talker's prefill is (text part + codec part, per position):

    U:                      text_projection(thinker_embed(u))          + 0
    <|im_start|> assistant \\n: text_projection(thinker_embed(.))        + 0
    4 positions:            tts_pad                                    + codec nothink, think_bos, think_eos, speaker
    1 position:             tts_bos                                    + codec_pad
    last position:          text_projection(thinker_embed(t0))         + codec_bos

where `tts_* = text_projection(thinker_embed(tts_*_token_id))`. Everything before the last position is
known once the prompt is, so the pipeline can prefill it while the Thinker is still prefilling
(`talker_prompt_prefix`); the last position needs only the id of t0 (`talker_prompt_last`).

Text-only prompts (and audio, whose M-RoPE positions are sequential too) use positions 0, 1, 2, ...
equal across the three M-RoPE components, as the reference's `get_rope_index` gives for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from omni_rt.errors import ConfigError, InvalidRequestError
from omni_rt.model.config import DecoderConfig, OmniConfig, TokenIds
from omni_rt.model.device_ids import to_device
from omni_rt.model.layers import DecoderLayer, KVCache, RMSNorm, Rotary, attention_mask
from omni_rt.prompt_layout import (
    talker_text_id,  # noqa: F401 - the rule lives there; re-exported
    user_turn_positions,
)


class StepTables(NamedTuple):
    """What the code predictor's layers share within a step: RoPE cos, sin [B, T, D], mask (`attention_mask`)."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor


# `sample(logits[B, V]) -> ids[B]`: a pure function of logits (greedy, or sampling with its own generator)
SampleFn = Callable[[torch.Tensor], torch.Tensor]
# `embed_text(ids[...]) -> [..., thinker_hidden]`: the Thinker's input embedding (`Thinker.embed`)
EmbedFn = Callable[[torch.Tensor], torch.Tensor]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim: [B, V] -> [B]."""
    return logits.argmax(dim=-1)


class ResizeMLP(nn.Module):
    """thinker width -> talker width: fc2(silu(fc1(x))), with biases (`text_projection`, `hidden_projection`)."""

    def __init__(self, in_size: int, intermediate_size: int, out_size: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(intermediate_size, out_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


# ---------------------------------------------------------------------------------------------------------
# Code predictor: codes 1..15 of a frame


class CodePredictorModel(nn.Module):
    """`code_predictor.model`: 15 code embeddings (group 1..15), dense decoder layers, final norm."""

    def __init__(self, cfg: DecoderConfig, num_code_groups: int) -> None:
        super().__init__()
        self.codec_embedding = nn.ModuleList(
            [nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(num_code_groups - 1)]
        )
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CodePredictor(nn.Module):
    """Predicts codes 1..15 of a frame: a 2-position prefill then 14 single steps, greedy or sampled.

    Position 0 holds the Talker's last (normed) hidden state, position 1 the Talker's embedding of code 0;
    head `lm_head[i]` predicts code i+1 from the last position, and code i+1 enters the next step
    through `model.codec_embedding[i]` (i = 0..13; code 15 is embedded only by the next Talker step).
    A fresh sequence every frame, so its cache is tiny (one row per batch element, 16 positions) and
    never needs clearing (see layers.KVCache).
    """

    def __init__(self, cfg: DecoderConfig, num_code_groups: int) -> None:
        super().__init__()
        if cfg.is_moe:
            raise ConfigError("the code predictor is a dense decoder; its config has num_experts > 0")
        self.cfg = cfg
        self.num_code_groups = num_code_groups
        self.model = CodePredictorModel(cfg, num_code_groups)
        self.lm_head = nn.ModuleList(
            [nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(num_code_groups - 1)]
        )
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)  # plain RoPE: positions 0..15
        self.cache: KVCache | None = None
        self._steps_kept: dict[tuple, tuple] = {}  # the CPU's `_frame_steps`, by batch, dtype, device, mode
        # set from outside to run the whole frame in fused kernels (kernels/code_frame.py), same contract
        # as `predict`: (predictor, talker_hidden, code0_embed, sample) -> codes [B, 15]
        self.frame_fn: Callable[..., torch.Tensor] | None = None

    def setup_cache(self, max_batch: int, device: torch.device | str | None = None, dtype=None) -> KVCache:
        """Allocate the predictor's static cache: [layers, max_batch, kv_heads, 16, head_dim]."""
        p = self.lm_head[0].weight
        self.cache = KVCache(
            self.cfg.num_hidden_layers,
            max_batch,
            self.cfg.num_key_value_heads,
            self.num_code_groups,
            self.cfg.head_dim,
            device=p.device if device is None else device,
            dtype=p.dtype if dtype is None else dtype,
        )
        return self.cache

    def _cache_for(self, batch: int, like: torch.Tensor) -> KVCache:
        # plain-Python check; a pipeline calls setup_cache once at load so this never allocates in a graph
        c = self.cache
        if c is None or c.n_slots < batch or c.device != like.device or c.dtype != like.dtype:
            c = self.setup_cache(max(batch, c.n_slots if c is not None else 0), like.device, like.dtype)
        return c

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        kv_len: int | None = None,
        tables: StepTables | None = None,
    ) -> torch.Tensor:
        """embeds [B, T, H], positions [B, T] -> normed hidden [B, T, H].

        kv_len: attend over cache rows [0, kv_len) only (above every position); default the whole cache.
        tables: `step_tables(positions, kv_len)` made earlier (the same values), or None to make them.
        """
        kv_len = cache.max_len if kv_len is None else kv_len
        cos, sin, mask = tables or self.step_tables(positions, kv_len, embeds.dtype)
        h = embeds
        for layer in self.model.layers:
            h = layer(h, cos, sin, cache, slots, positions, kv_len, mask)
        return self.model.norm(h)

    def predict(
        self, talker_hidden: torch.Tensor, code0_embed: torch.Tensor, sample: SampleFn = greedy
    ) -> torch.Tensor:
        """talker_hidden [B, H], code0_embed [B, H] (the Talker's codec_embedding of code 0) -> codes [B, 15].

        Static shapes and no host sync: a whole frame can be captured in one CUDA graph.
        """
        width = self.cfg.hidden_size
        if (
            talker_hidden.dim() != 2
            or talker_hidden.shape[1] != width
            or code0_embed.shape != talker_hidden.shape
        ):
            raise InvalidRequestError(
                f"talker_hidden and code0_embed must both be [B, {width}], got {tuple(talker_hidden.shape)} "
                f"and {tuple(code0_embed.shape)}"
            )
        if self.frame_fn is not None:
            return self.frame_fn(self, talker_hidden, code0_embed, sample)
        b = talker_hidden.shape[0]
        cache = self._cache_for(b, talker_hidden)
        x = torch.stack((talker_hidden, code0_embed), dim=1)  # [B, 2, H]
        slots, steps = self._frame_steps(b, x.dtype, x.device)
        codes = []
        for i, (positions, tables) in enumerate(steps):
            # step i sees exactly rows [0, i + 2), as the reference's growing cache does: the same rows
            # give the same bf16 rounding in attention (and the 2-token prefill is plain causal there).
            # A Python int per step, so a captured frame stays static.
            h = self(x, positions, cache, slots, kv_len=i + 2, tables=tables)[:, -1]  # [B, H]
            code = sample(self.lm_head[i](h))  # [B]
            codes.append(code)
            if i + 1 < len(steps):
                x = self.model.codec_embedding[i](code).unsqueeze(1)  # [B, 1, H]: code i+1 enters step i+1
        return torch.stack(codes, dim=1)  # [B, 15]

    def step_tables(self, positions: torch.Tensor, kv_len: int, dtype: torch.dtype) -> StepTables:
        """RoPE cos, sin [B, T, head_dim] and the attention mask that every layer of a step shares."""
        cos, sin = self.rotary(positions, dtype)
        rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        return StepTables(cos, sin, attention_mask(positions, kv_len, rep))

    def _frame_steps(
        self, b: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, StepTables | None]]]:
        """Slots [B] and each step's positions ([B, 2] for the first, then [B, 1]) and tables.

        Every frame's steps are at the same positions, so on the CPU their tables are made once per
        batch size and kept: RoPE and the mask are a fifth of a step's ops there, where a step costs
        its op dispatch (docs/performance.md, 2026-12-01 night). A device computes them in each frame,
        inside its captured graph (tables None)."""
        key = (b, dtype, device, torch.is_inference_mode_enabled())  # inference tensors stay in it
        if key in self._steps_kept:
            return self._steps_kept[key]
        positions = [torch.arange(2, device=device).expand(b, 2)]  # [B, 2]: the frame's 2-token prefill
        positions += [
            torch.full((b, 1), i + 1, dtype=torch.long, device=device)
            for i in range(1, self.num_code_groups - 1)
        ]
        cpu = torch.device(device).type == "cpu"
        steps = [(p, self.step_tables(p, i + 2, dtype) if cpu else None) for i, p in enumerate(positions)]
        made = torch.arange(b, device=device), steps
        if cpu:
            self._steps_kept[key] = made
        return made


# ---------------------------------------------------------------------------------------------------------
# Talker


class TalkerModel(nn.Module):
    """`talker.model`: codec embedding (code 0 / specials), MoE decoder layers with shared expert, norm."""

    def __init__(self, cfg: DecoderConfig, moe_impl: str = "auto") -> None:
        super().__init__()
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, moe_impl) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Talker(nn.Module):
    """`talker.*` of the checkpoint: `model`, `codec_head`, `text_projection`, `hidden_projection`,
    `code_predictor`."""

    def __init__(self, cfg: OmniConfig, moe_impl: str = "auto") -> None:
        super().__init__()
        tk, cp = cfg.talker, cfg.code_predictor
        if cp.hidden_size != tk.hidden_size:
            raise ConfigError(
                f"code predictor hidden_size {cp.hidden_size} must equal the Talker's {tk.hidden_size}: "
                "it reads the Talker's hidden state and code embeddings directly"
            )
        if not tk.is_moe or tk.shared_expert_intermediate_size <= 0:
            raise ConfigError(
                "the Talker is an MoE decoder with a shared expert (num_experts, shared_expert_*)"
            )
        self.cfg = cfg
        self.ids: TokenIds = cfg.ids
        self.num_code_groups = cfg.num_code_groups
        self.model = TalkerModel(tk, moe_impl)
        self.codec_head = nn.Linear(tk.hidden_size, tk.vocab_size, bias=False)
        # text_projection: Thinker input embeddings (all text); hidden_projection: Thinker hidden states
        # at multimodal placeholders of user turns. Both are 2-layer MLPs of the Talker's intermediate width.
        self.text_projection = ResizeMLP(cfg.thinker.hidden_size, tk.intermediate_size, tk.hidden_size)
        self.hidden_projection = ResizeMLP(cfg.thinker.hidden_size, tk.intermediate_size, tk.hidden_size)
        self.code_predictor = CodePredictor(cp, cfg.num_code_groups)
        self.rotary = Rotary(tk.head_dim, tk.rope_theta, tk.mrope_section)

    def allocate_cache(
        self, n_slots: int, max_len: int, device: torch.device | str | None = None, dtype=None
    ) -> KVCache:
        """A static Talker cache: [layers, n_slots, kv_heads, max_len, head_dim]."""
        tk = self.cfg.talker
        p = self.codec_head.weight
        return KVCache(
            tk.num_hidden_layers,
            n_slots,
            tk.num_key_value_heads,
            max_len,
            tk.head_dim,
            device=p.device if device is None else device,
            dtype=p.dtype if dtype is None else dtype,
        )

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        kv_len: int | None = None,
        *,
        rope_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs_embeds [B, T, Ht], positions [B, T], slots [B] -> (logits [B, T, codec_vocab], hidden [B, T, Ht]).

        `hidden` is after the final norm: the code predictor's input at the frame's position 0.
        positions are the cache rows (and causal limits) of the new tokens; rope_positions [3, B, T] are
        (t, h, w) M-RoPE positions for image/video prompts, defaulting to `positions` (text and audio).
        kv_len (a Python int, static per CUDA graph): attend over cache rows [0, kv_len) only; it must
        exceed every position. Defaults to the whole cache.
        """
        cache.check_access(self.cfg.talker, inputs_embeds, positions, slots, kv_len, "Talker")
        if rope_positions is not None and tuple(rope_positions.shape) != (3, *positions.shape):
            raise InvalidRequestError(
                f"rope_positions must be [3, B, T] = {[3, *positions.shape]}, got {tuple(rope_positions.shape)}"
            )
        kv_len = cache.max_len if kv_len is None else kv_len
        rope = positions if rope_positions is None else rope_positions
        cos, sin = self.rotary(rope, inputs_embeds.dtype)  # [B, T, head_dim]
        tk = self.cfg.talker
        mask = attention_mask(positions, kv_len, tk.num_attention_heads // tk.num_key_value_heads)
        h = inputs_embeds
        for layer in self.model.layers:
            h = layer(h, cos, sin, cache, slots, positions, kv_len, mask)  # [B, T, Ht]
        h = self.model.norm(h)
        return self.codec_head(h), h

    def project_text(self, thinker_embeds: torch.Tensor) -> torch.Tensor:
        """[..., thinker_hidden] -> [..., Ht]."""
        return self.text_projection(thinker_embeds)

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Sum of a frame's 16 code embeddings: codes [B, 16] -> [B, Ht].

        Code 0 through the Talker's codec_embedding, code g (1..15) through the code predictor's
        codec_embedding[g - 1]; summed over one stacked dim in group order, as the reference does.
        """
        embs = [self.model.codec_embedding(codes[:, 0])]
        embs += [emb(codes[:, g + 1]) for g, emb in enumerate(self.code_predictor.model.codec_embedding)]
        return torch.stack(embs, dim=1).sum(dim=1)  # [B, 16, Ht] -> [B, Ht]

    def predict_frame(
        self, hidden: torch.Tensor, code0: torch.Tensor, sample: SampleFn = greedy
    ) -> torch.Tensor:
        """The Talker's last hidden [B, Ht] and its code 0 [B] -> the whole frame's codes [B, 16]."""
        if code0.shape != hidden.shape[:1]:
            raise InvalidRequestError(f"code0 must be [B] = [{hidden.shape[0]}], got {tuple(code0.shape)}")
        rest = self.code_predictor.predict(hidden, self.model.codec_embedding(code0), sample)  # [B, 15]
        return torch.cat((code0.unsqueeze(1), rest), dim=1)


# ---------------------------------------------------------------------------------------------------------
# Prompt construction (pure functions; one sequence at a time for the prefill, batched for steps)


def _host_ids(ids: Sequence[int] | torch.Tensor) -> list[int]:
    """One prompt [T] (or [1, T]) as host ints: the Talker's prompt layout is read on the host, so that
    building a prompt puts nothing but copies and gathers on the device (no host sync: on a GPU each one
    waited for every frame the Talker's stream had queued for other conversations)."""
    if not isinstance(ids, torch.Tensor) and all(type(x) is int for x in ids):
        return list(ids)
    t = torch.as_tensor(ids, dtype=torch.long)  # a tensor, or nested lists
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise InvalidRequestError(f"prompt ids must be one sequence [T], got shape {tuple(t.shape)}")
    return t.tolist()


def check_prompt(prompt_ids: Sequence[int] | torch.Tensor, ids: TokenIds) -> None:
    """A Talker prompt ends with the assistant header `<|im_start|> assistant \\n`: the Thinker's reply is
    what the Talker speaks, starting at its first generated token."""
    p = _host_ids(prompt_ids)
    if p[-3:] != [ids.im_start, ids.assistant, ids.newline]:
        raise InvalidRequestError(
            "a prompt for speech must end with the assistant header [<|im_start|>, assistant, \\n] "
            f"= {[ids.im_start, ids.assistant, ids.newline]}; it ends with {p[-3:]}"
        )


def talker_prompt_prefix(
    talker: Talker,
    embed_text: EmbedFn,
    prompt_ids: Sequence[int] | torch.Tensor,
    speaker_id: int,
    prompt_hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every Talker prefill position but the last: [L - 1, Ht] (all user-turn tokens, then 8 assistant ones).

    prompt_ids [T] is the Thinker's chat prompt, ending with `<|im_start|> assistant \\n`.
    prompt_hidden [T, thinker_hidden]: the Thinker's `hidden_states[accept_hidden_layer]` over the prompt,
    needed only when user turns hold audio/image/video placeholders (read through `hidden_projection`).
    Which positions it takes is `omni_rt.prompt_layout.user_turn_positions`, read on the host.
    """
    i = talker.ids
    w = talker.codec_head.weight
    dev = w.device
    prompt = _host_ids(prompt_ids)  # [T]
    check_prompt(prompt, i)
    user = user_turn_positions(prompt, i.im_start, i.user)  # [U] positions
    parts = []
    if user:
        user_part = talker.project_text(embed_text(to_device([prompt[k] for k in user], dev)))  # [U, Ht]
        media = (i.audio, i.image, i.video)
        mm = [j for j, k in enumerate(user) if prompt[k] in media]  # [M] rows of user_part
        if mm:
            if prompt_hidden is None:
                raise InvalidRequestError(
                    "the prompt has audio/image/video placeholders in a user turn: the Talker needs the "
                    "Thinker's hidden states there (prompt_hidden)"
                )
            if prompt_hidden.shape[0] != len(prompt):
                raise InvalidRequestError(
                    f"prompt_hidden has {prompt_hidden.shape[0]} positions, the prompt {len(prompt)}"
                )
            rows = to_device([user[j] for j in mm], prompt_hidden.device)
            mm_part = talker.hidden_projection(prompt_hidden[rows].to(w.dtype))  # [M, Ht]
            user_part = user_part.index_copy(0, to_device(mm, dev), mm_part.to(user_part.dtype))
        parts.append(user_part)

    # the assistant header's three tokens, projected, with no codec part
    parts.append(talker.project_text(embed_text(to_device(prompt[-3:], dev))))  # [3, Ht]
    tts_pad, tts_bos = talker.project_text(embed_text(to_device([i.tts_pad, i.tts_bos], dev))).unbind(0)
    codec = to_device([i.codec_nothink, i.codec_think_bos, i.codec_think_eos, speaker_id, i.codec_pad], dev)
    codec_embeds = talker.model.codec_embedding(codec)  # [5, Ht]
    text = torch.stack([tts_pad] * 4 + [tts_bos])  # [5, Ht]
    parts.append(text + codec_embeds)
    return torch.cat(parts, dim=0)  # [U + 8, Ht]


def talker_prompt_last(talker: Talker, embed_text: EmbedFn, first_token: torch.Tensor) -> torch.Tensor:
    """The last prefill position: projected first generated token + codec_bos. first_token [B] -> [B, Ht]."""
    bos = torch.full_like(first_token, talker.ids.codec_bos)
    return talker.project_text(embed_text(first_token)) + talker.model.codec_embedding(bos)


def talker_prompt(
    talker: Talker,
    embed_text: EmbedFn,
    prompt_ids: Sequence[int] | torch.Tensor,
    speaker_id: int,
    first_token: int | torch.Tensor,
    prompt_hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole Talker prefill of one sequence: [L, Ht] = prefix [L - 1, Ht] then the first-token position."""
    prefix = talker_prompt_prefix(talker, embed_text, prompt_ids, speaker_id, prompt_hidden)
    first = torch.as_tensor(first_token, dtype=torch.long, device=prefix.device).reshape(1)
    return torch.cat((prefix, talker_prompt_last(talker, embed_text, first)), dim=0)


def talker_step_input(
    talker: Talker, embed_text: EmbedFn, codes: torch.Tensor, text_ids: torch.Tensor
) -> torch.Tensor:
    """Input of a Talker decode step: last frame's codes [B, 16], text ids [B] (`talker_text_id`) -> [B, Ht].

    tts_eos and tts_pad are Thinker-vocabulary ids too, so every step is the same static computation.
    """
    return talker.embed_codes(codes) + talker.project_text(embed_text(text_ids))
