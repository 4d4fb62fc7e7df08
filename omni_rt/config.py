"""Public settings of omni_rt: engine, session and sampling, as pydantic models validated at construction.

Every pipeline optimisation is a switch on `EngineSettings`, so the benchmark can turn each one off and
show its share; `EngineSettings.all_off()` behaves like a stock serving stack (the Talker starts after the
Thinker's output of a whole step arrives, an extra Talker step before frame 0, fixed 4-frame Code2Wav
chunks, no Thinker yield, no CUDA graphs).

Model shapes are not here: they live in `omni_rt.model.config` (frozen dataclasses read from a
checkpoint's config.json or a preset).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omni_rt.model.config import PRESETS

__all__ = ["PRESETS", "EngineSettings", "SessionSettings", "StageSampling", "Sampling", "OUTPUT_SAMPLE_RATES"]

# PCM rates a session can ask for: the model's native 24 kHz, WebRTC's 48 kHz, speech tooling's 16 kHz.
OUTPUT_SAMPLE_RATES = (24000, 48000, 16000)


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSettings(_Settings):
    """How the engine runs the pipeline. Defaults are the fastest configuration."""

    # capacity: caches are allocated once at engine start, one slot per open session
    max_sessions: int = Field(4, ge=1, le=256, description="session slots (KV cache rows) per stage")
    max_context: int = Field(4096, ge=16, description="Thinker KV cache length per session (tokens)")
    max_talker_context: int = Field(4096, ge=16, description="Talker KV cache length per session")
    event_queue_size: int = Field(4096, ge=16, description="events buffered per session before failing it")
    admission_wait_s: float = Field(
        0.0,
        ge=0.0,
        le=3600.0,
        description="how long a session asked for beyond `max_sessions` waits (first come, first served) "
        "for one that closes before it gets `SessionLimitError` (code `session_limit`); 0: at once",
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0.0,
        description="ceiling of the stage caches' memory (GiB): the Thinker's at `max_context`, the Talker's "
        "at `max_talker_context` and the code predictor's, for `max_sessions` slots plus the one graph "
        "capture writes into, in the model's dtype; more is a ConfigError at load that says how many "
        "sessions fit. None: no ceiling",
    )

    # pipeline optimisations (each one can be turned off)
    encode_while_speaking: bool = Field(
        True,
        description="encode a spoken turn as it arrives (Session.live_speech), on a low-priority worker "
        "thread, so its end leaves only the last encoder window and the prefill",
    )
    talker_overlap_prefill: bool = Field(
        True, description="prefill the Talker's prompt prefix while the Thinker prefills"
    )
    frame0_in_prefill: bool = Field(
        True, description="run the code predictor for frame 0 in the step that finishes the Talker prefill"
    )
    frames_in_step: bool = Field(
        True,
        description="run the code predictor for each Talker step's frame right behind the step on the device, "
        "read back with its code 0 in one sync (as frame0_in_prefill does for frame 0): no host round trip "
        "and no second launch wait between a step and its frame. The same codes; a frame whose code 0 is "
        "the codec's end is made and dropped",
    )
    early_start: bool | None = Field(
        None,
        description="None: on where the model runs on a CUDA device (off the GPU a stage call is done when it "
        "returns: nothing to gain). With talker_overlap_prefill, for a response that starts alone while the Talker (and "
        "Code2Wav) hold no other: its Talker last prompt position and frame 0, and (with frame0_in_prefill) its "
        "first Code2Wav chunk, are enqueued on the GPU as soon as its Thinker prefill is, each stage's stream "
        "waiting on an event for the stage before and reading the first token and frame 0 on the device. The host "
        "reads them back as before and finds the work done, where otherwise each hop to the first audio waits for "
        "a read-back, a thread's wake-up and a graph launch. The same tokens, codes and PCM. On an H200 first "
        "audio came at 27.5 ms with it against 28.3 ms without (docs/performance.md, 2026-12-05); starts that come "
        "together from one prefill go the usual way (8 at once early took 57.5 ms against 41.2)",
    )
    batch_prefill: bool = Field(
        True, description="prefill the requests that arrive together in one batched call (right-padded)"
    )
    handoff: Literal["event", "after_step"] = Field(
        "event",
        description="'event': each Thinker token goes to the Talker the moment it is sampled; "
        "'after_step': a step's tokens are handed over when the Thinker's next step completes (stock)",
    )
    prefill_piece_tokens: int | None = Field(
        256,
        ge=16,
        description="a text prompt longer than this is prefilled in pieces of this many tokens, one piece "
        "between two decode steps of the other conversations, so that a long prompt never holds their text "
        "(and their audio) for longer than one piece; None: every prompt in one call",
    )
    first_chunk_frames: int = Field(1, ge=1, le=64, description="codec frames in the first Code2Wav chunk")
    chunk_growth: bool = Field(True, description="let the Code2Wav chunk grow, doubling (`chunk_plan_rate`)")
    max_chunk_frames: int = Field(16, ge=1, le=256, description="cap on a grown Code2Wav chunk")
    code2wav_batch: bool | None = Field(
        None,
        description="decode the next chunks of every response whose chunk is no longer than the most urgent "
        "one's in one batched call (ragged: each its own size; each row its own stream, up to a batched kernel's float rounding: PCM "
        "within one LSB; one at a time in deterministic mode). None: on where Engine.load puts the model on "
        "a GPU (8 requests arriving at once on an H200: TTFA median 70.2 ms one chunk at a time, 50.9 ms "
        "batched, a single request's unchanged, 30.7 / 31.0 ms; docs/performance.md), off on the CPU "
        "(not measured there; one at a time, a response's PCM is the same alone or beside others)",
    )
    code2wav_ragged: bool = Field(
        True,
        description="with code2wav_batch, a call also takes the due chunks shorter than the most urgent one's, "
        "each row padded to the longest (its padding leaves no trace in its stream); False: only chunks of "
        "that one's size (the rule before 2026-12-04, kept for comparison)",
    )
    chunk_plan_rate: float | None = Field(
        None,
        ge=1.0,
        le=2.0,
        description="the rate of the Talker's frames (times real time) that the Code2Wav chunk plan counts on: "
        "a chunk doubles only once its frames, arriving at that rate, are all there before the audio decoded "
        "so far (and `playout_lead_ms`) has played (`chunk_size`). 2: plain doubling, 1, 2, 4, ... (a GPU makes "
        "frames 10x faster than real time); None: 2, or 1.1 where Engine.load puts the model on the CPU, "
        "whose frames come 1.1-1.45x real time on 2 cores: the plan holds at the slow end, not the middle "
        "(at 1.25 a busy neighbour ran Chromium's track dry; docs/performance.md)",
    )
    playout_lead_ms: int | None = Field(
        None,
        ge=0,
        le=2000,
        description="audio a player holds before it starts a reply; the chunk plan counts on it, and the "
        "server's WebRTC track holds it (PeerSettings.start_lead_ms). None: 0, or 100 where Engine.load puts "
        "the model on the CPU (the second chunk's frames come ~2 frame intervals after the first chunk's "
        "57 ms of audio: docs/performance.md)",
    )
    yield_to_talker_ms: float = Field(
        12.0,
        ge=0.0,
        le=1000.0,
        description="longest the Thinker's next step waits for a pending frame 0 (or first audio, `yield_until`); "
        "the design card's 12 ms: on an H200 the first PCM chunk is out ~10 ms after the first token",
    )
    max_text_lead: int | None = Field(
        32,
        ge=1,
        description="audio before text: the Thinker decodes no further than this many tokens ahead of what "
        "the Talker has spoken (32 tokens: ~2.5 s of speech queued); None: as fast as it can",
    )
    urgent_text_lead: int | None = Field(
        2,
        ge=1,
        description="audio before text while the audio is due: until a response's audio is `audio_ahead_s` "
        "ahead of real-time playback, the Thinker stays at most this many tokens ahead of the Talker (instead "
        "of max_text_lead), so that on a small CPU the Talker and Code2Wav get the cores; None: max_text_lead "
        "throughout",
    )
    text_due_lead: int | None = Field(
        None,
        ge=0,
        description="with a text lead: the Thinker runs a decode step only when some reply is at most this many "
        "tokens ahead of its voice (its text is due), and the step then takes every reply below its lead "
        "(pipeline/pacing.text_due). Held at their leads, replies come free one frame at a time, so at many "
        "conversations steps ran back to back with the few replies freed since the last; this makes fewer "
        "steps of more rows, for the same tokens. None: a step whenever any reply may decode. Off until "
        "measured",
    )
    prompt_first_s: float | None = Field(
        None,
        gt=0.0,
        le=10.0,
        description="a new prompt before text that can wait: when a prompt waits for the Thinker at a decode step, "
        "the step takes only the replies whose voice runs out of text within this many seconds "
        "(pipeline/pacing.text_runs_dry_at: real-time playback from the first PCM through every frame made or "
        "makeable from the text out; a reply with no audio yet always goes), and the others wait for the "
        "prompt's prefill. Without it, a prompt that arrives during another's prefill or first-audio yield "
        "waits behind a whole decode step of every reply (at 64 conversations on an H200, 18.5 ms for half "
        "the replies; docs/performance.md, 2026-12-05 third session). None: off until measured",
    )
    talker_audio_lead_s: float | None = Field(
        None,
        gt=0.0,
        description="audio before audio: the Talker makes a reply's frames no further than this many seconds of "
        "audio ahead of its playback (real time from its first PCM), and steps when some reply is within "
        "talker_due_s of it (pipeline/pacing.talker_due), taking then every reply below this lead, so that at "
        "many conversations its steps, and the Thinker's that feed them, carry most replies at once. A reply "
        "with no audio yet is always due. None: as fast as its text allows. Off until measured",
    )
    talker_due_s: float = Field(
        1.0,
        gt=0.0,
        description="with talker_audio_lead_s: a reply whose frames are at most this many seconds of audio "
        "ahead of its playback calls for a Talker step",
    )
    audio_ahead_s: float = Field(
        1.0,
        ge=0.0,
        le=60.0,
        description="audio ahead of real time that lets the Thinker lead by max_text_lead",
    )
    early_chunks: bool | None = Field(
        None,
        description="when the audio sent would run out before the planned Code2Wav chunk's frames arrive (at "
        "the rate the latest have been arriving), decode a smaller planned chunk size (omni_rt.pipeline.pacing). "
        "Chunks then follow the timing, so PCM is reproducible only to float rounding (1 LSB of int16); never "
        "in deterministic mode. None: on where Engine.load puts the model on a GPU (at 64 conversations on an "
        "H200 frames come at ~1.4x real time, and the plan's chunks of 16 ran replies dry; 2026-12-04), off "
        "on the CPU (on one that barely keeps up, the smaller chunks' cost made the RTF worse, 2026-12-01)",
    )
    yield_until: Literal["frame0", "first_audio"] = Field(
        "first_audio",
        description="what the Thinker's yield (`yield_to_talker_ms`) waits for: the response's frame 0 leaving "
        "the Talker, or its first PCM chunk leaving Code2Wav (the first chunk then runs without the Thinker's "
        "decode beside it on the GPU)",
    )
    cuda_graphs: bool = Field(True, description="capture per-token/per-frame steps in CUDA graphs (GPU only)")
    prefill_graphs: bool = Field(
        True,
        description="with cuda_graphs: also capture the Thinker prefill and the Talker prompt-prefix prefill, "
        "right-padded to `prefill_buckets` tokens (eager above the largest bucket)",
    )
    prefill_buckets: tuple[int, ...] = Field(
        (16, 32, 64, 128, 256, 512), description="padded prefill lengths captured (one graph each)"
    )
    prefill_graph_batches: int = Field(
        8,
        ge=1,
        le=256,
        description="batched prefills of up to this many requests that arrive together are graphed too: the "
        "Thinker's prompts, the Talker's prompt prefixes and first positions (with frame 0); 1: one graphed "
        "call per request (a batch without a graph would run eagerly). 8 at once on an H200: first audio "
        "after 70 ms at 8, 295 ms at 1, single requests unchanged (docs/performance.md, 2026-12-02)",
    )
    prefill_launch_order: bool = Field(
        True,
        description="the Talker's overlapped prefix prefill waits (at most 20 ms) until the Thinker's prefill "
        "is enqueued, so the two threads do not fight over the GIL and the launch queue",
    )
    thinker_graph_segments: int = Field(
        1,
        ge=1,
        le=64,
        description="with cuda_graphs: the Thinker's decode step and prefill each as this many CUDA graphs "
        "launched back to back (its layers split evenly), not one. A launch holds the CUDA driver's lock while it "
        "pushes its kernels (the 1149-kernel decode step took ~2.8 ms of host time a launch at 64 conversations "
        "on an H200), and the other stage threads' copies and launches wait for it (docs/performance.md, "
        "2026-12-04 third session); shorter launches let them in between, and a prefill's first kernels start "
        "while the rest are pushed. The same results; 1 until measured (scripts/gpu_launch_lock.py)",
    )
    pinned_readback: bool = Field(
        True,
        description="on a GPU, read each step's ids and each chunk's PCM back through pinned memory after a wait on "
        "an event, not by a blocking copy into pageable memory, which may hold the CUDA driver's lock while it "
        "waits for the stage's stream, so that another stage thread's launches wait too (at 64 conversations "
        "on an H200 the Talker thread spent 13 % of its time in such copies, blocked on the driver's mutex). "
        "The same values. At 64 conversations on an H200: 0 of 193 replies late with it, 9 without, in one "
        "run (docs/performance.md, 2026-12-05)",
    )
    moe_backend: Literal["auto", "plain", "loop", "gather", "grouped_mm", "triton"] = Field(
        "auto",
        description="expert FFN backend. 'auto': the Triton decode kernel (omni_rt.kernels.moe_decode, up to 16 "
        "token rows, grouped_mm above) where the model runs on a CUDA device and Triton imports, else 'plain'; "
        "'plain': plain PyTorch (grouped_mm on CUDA in bf16, the loop elsewhere); 'loop' | 'gather' | "
        "'grouped_mm': that SparseMoe impl of omni_rt.model.layers; 'triton': the kernel, an error where it "
        "cannot run",
    )
    moe_prefill_kernel: bool | None = Field(
        None,
        description="with the Triton MoE decode kernel: prefill-sized MoE calls (over 16 token rows) run the "
        "Triton grouped GEMM of omni_rt.kernels.moe_prefill instead of torch's grouped_mm. None: where "
        "Triton runs on a CUDA device; True: on, an error where it cannot run; False: grouped_mm",
    )
    packed_projections: bool | None = Field(
        None,
        description="one GEMM for each attention's q/k/v and each dense MLP's gate/up (omni_rt.kernels.packed; "
        "plain PyTorch, weights packed in place). None: on a CUDA device; True: on; False: off",
    )
    fused_kernels: bool | None = Field(
        None,
        description="Triton kernels for RMSNorm, q/k norm + RoPE + cache write, the router, decode attention "
        "and SnakeBeta (omni_rt.kernels.fused). None: on where the model runs on a CUDA device and Triton "
        "imports; True: on, an error where they cannot run; False: off (plain PyTorch)",
    )
    programmatic_launch: Literal["off", "idle", "always"] = Field(
        "idle",
        description="the code-predictor frame's few-rows kernels as programmatic dependent launches (sm_90+: "
        "each kernel's launch and weight loads overlap the previous kernel's tail). 'idle': frames of up to "
        "4 rows while the Thinker has no work on the GPU (a second set of frame graphs), the others as "
        "'off'; 'always': every frame; 'off': none. Alone they take the frame at batch 1 from 2.26 to 1.89 ms "
        "sampled (2.13 -> 1.76 greedy) on an H100, but launched beside the Thinker they slowed its decode "
        "step (6.42 ms against 5.89) and 64 conversations' TTFA p50 (64 ms against 56-58) on an H200. 'idle' "
        "costs nothing measurable: single requests, 8 at once and 1-32 conversations as fast or faster than "
        "'off' in the same run (docs/performance.md, 2026-12-05 (sixth session), H100). True and False mean "
        "'always' and 'off'",
    )
    fused_code2wav: bool = Field(
        True,
        description="with fused_kernels, Code2Wav's streaming step in fused kernels too (kernels/code2wav_step.py: "
        "619 -> 411 launches, a 1-frame chunk 2.05 -> 1.58 ms on an H200); False keeps only its SnakeBeta and "
        "RMSNorm fused, for comparison",
    )
    cpu_stage_threads: int | None = Field(
        1,
        ge=1,
        le=256,
        description="torch intra-op threads of each stage thread when the model runs on the CPU. The three "
        "stage threads run at once, so torch's default (a thread per core for each) oversubscribes the cores, "
        "and a parallel op then waits for a helper thread that another stage's work has descheduled (torch "
        "also makes it the default of threads that have not run torch yet); None: torch's default",
    )
    freeze_collector: bool = Field(
        True,
        description="while the engine runs, what was alive at its start (the model, torch, the app's long-lived "
        "objects) is frozen out of Python's cycle collector (`gc.freeze`), so a full collection, which holds "
        "the interpreter lock and so every stage thread, scans only what came later (omni_rt/collector.py). "
        "Reference counting still frees frozen objects; cycles among them wait for the engine's stop",
    )
    deterministic: bool = Field(
        False,
        description="run every sequence's step on its own (batch-invariant results) instead of batching",
    )
    stall_timeout_s: float | None = Field(
        60.0,
        gt=0.0,
        description="a stage iteration (milliseconds, or seconds where a first use compiles a kernel) that has "
        "not returned after this long means the device stopped: every response in flight ends with "
        "`engine_stalled`, new ones are refused, the server's /health says so (503) and the threads' stacks "
        "go to stderr (pipeline/watchdog.py); None: no watch",
    )

    @field_validator("programmatic_launch", mode="before")
    @classmethod
    def _programmatic_bool(cls, value: object) -> object:
        # it was a bool until 'idle' came (2026-12-05): True was every frame
        return {True: "always", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _buckets(self) -> EngineSettings:
        if not self.prefill_buckets or self.prefill_buckets[0] < 1:
            raise ValueError(f"prefill_buckets must be positive lengths, got {self.prefill_buckets}")
        if list(self.prefill_buckets) != sorted(set(self.prefill_buckets)):
            raise ValueError(f"prefill_buckets must be strictly increasing, got {self.prefill_buckets}")
        return self

    @model_validator(mode="after")
    def _chunks(self) -> EngineSettings:
        if self.max_chunk_frames < self.first_chunk_frames:
            raise ValueError(
                f"max_chunk_frames ({self.max_chunk_frames}) < first_chunk_frames ({self.first_chunk_frames})"
            )
        return self

    @property
    def starts_early(self) -> bool:
        """Are responses' starts enqueued on the device ahead of the host (`early_start`)? It needs the
        Talker's prompt prefix in its cache before the first token (`talker_overlap_prefill`)."""
        return bool(self.early_start) and self.talker_overlap_prefill

    @classmethod
    def all_off(cls, **overrides: object) -> EngineSettings:
        """Every optimisation off: what a stock serving stack does (the benchmark's baseline row)."""
        base: dict[str, object] = dict(
            talker_overlap_prefill=False,
            early_start=False,
            frame0_in_prefill=False,
            frames_in_step=False,
            batch_prefill=False,
            handoff="after_step",
            first_chunk_frames=4,
            chunk_growth=False,
            max_chunk_frames=4,
            early_chunks=False,
            yield_to_talker_ms=0.0,
            yield_until="frame0",
            max_text_lead=None,
            urgent_text_lead=None,
            cuda_graphs=False,
            prefill_graphs=False,
            pinned_readback=False,
            prefill_launch_order=False,
            moe_backend="plain",
            moe_prefill_kernel=False,
            fused_kernels=False,
            packed_projections=False,
            programmatic_launch="off",
            cpu_stage_threads=None,
        )
        return cls(**(base | overrides))

    def chunk_sizes(self) -> list[int]:
        """Distinct Code2Wav chunk sizes the runner uses (fixed shapes, for graph capture)."""
        sizes, n = [], self.first_chunk_frames
        while True:
            sizes.append(n)
            if not self.chunk_growth or n >= self.max_chunk_frames:
                return sizes
            n = min(2 * n, self.max_chunk_frames)

    def for_device(self, kind: str) -> EngineSettings:
        """These settings with the defaults that depend on the device (`chunk_plan_rate`,
        `playout_lead_ms`, `code2wav_batch`, `early_chunks`, `early_start`) made concrete for a model on `kind` ("cpu", "cuda", ...)."""
        cpu = kind == "cpu"
        update: dict[str, object] = {}
        if self.chunk_plan_rate is None:
            update["chunk_plan_rate"] = 1.1 if cpu else 2.0
        if self.playout_lead_ms is None:
            update["playout_lead_ms"] = 100 if cpu else 0
        if self.code2wav_batch is None:
            update["code2wav_batch"] = not cpu
        if self.early_chunks is None:
            update["early_chunks"] = not cpu
        if self.early_start is None:
            update["early_start"] = not cpu
        return self.model_copy(update=update)

    @property
    def batch_starts(self) -> bool:
        """Do requests that arrive together share their prefill calls (the Thinker's prompts, the Talker's
        prefixes and first positions)? `batch_prefill`, except when deterministic: a request's numbers
        must not depend on who arrived with it."""
        return self.batch_prefill and not self.deterministic

    @property
    def chunks_early(self) -> bool:
        """Does Code2Wav decode a smaller chunk when the audio would run dry first? `early_chunks`, except
        when deterministic (chunks by the frame count alone: the same PCM on every run)."""
        return bool(self.early_chunks) and not self.deterministic

    @property
    def code2wav_batched(self) -> bool:
        """Do responses' Code2Wav chunks share a call (ragged)? `code2wav_batch`, except when
        deterministic (one at a time: batch-invariant)."""
        return bool(self.code2wav_batch) and not self.deterministic

    def chunk_size(self, decoded: int, held: float = 0.0) -> int:
        """Frames in a response's next Code2Wav chunk, after `decoded` frames of which `held` (in frames)
        are not out as audio yet: the first chunk size, then the largest planned size whose frames are
        all there before the audio already out has played.

        The plan's clock, in frames of audio (80 ms): frame 0 arrives at 0 and plays from 0 (after the
        lead), frame i arrives at i / rate. A chunk of frames [decoded, decoded + n) is whole at
        (decoded + n - 1) / rate, and what plays before it lasts until decoded - held + lead, so
        n <= 1 + decoded * (rate - 1) + (lead - held) * rate. The streaming decoder holds back the end
        of the latest frame (`held`: 555 of 1920 samples for the real model, so a first chunk of one
        frame is 57 ms, not 80): at rate 2 without a lead the plan is 1, 1, 2, 4, 8, ... (counting whole
        frames it was 1, 2, 4, ..., and a second chunk of two frames was due 57 ms after the first while
        its frames came 80 ms later at that rate: under load on an H200 it was every late reply's gap)."""
        sizes = self.chunk_sizes()
        if decoded == 0:
            return sizes[0]
        rate = 2.0 if self.chunk_plan_rate is None else self.chunk_plan_rate
        lead = (self.playout_lead_ms or 0) / 80.0
        most = 1 + decoded * (rate - 1) + (lead - held) * rate
        return max((n for n in sizes if n <= most + 1e-9), default=sizes[0])


def setting_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`KEY=VALUE` pairs (a command line's `--set`) as EngineSettings overrides: VALUE read as JSON
    (`urgent_text_lead=null`, `stall_timeout_s=20`), else as a string (`handoff=event`). A ValueError
    names a malformed pair or a KEY that is no setting; the values are checked where the settings are
    built."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in EngineSettings.model_fields:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY an EngineSettings field")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


# The stage samplers hold each slot's settings in float32 and int64 tensors: a value beyond them (1e300,
# inf, 10**30) failed the batched step that assigns it, and every other session's response in that step.
_FLOAT32_MAX = 3.4028234663852886e38


class StageSampling(_Settings):
    """Sampling of one stage. `do_sample=False` is greedy; repetition penalty applies in both modes."""

    do_sample: bool = True
    temperature: float = Field(1.0, gt=0.0, le=_FLOAT32_MAX)
    top_k: int = Field(0, ge=0, lt=2**63, description="0: no top-k filter")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=_FLOAT32_MAX)


def _thinker_default() -> StageSampling:
    # The Qwen3-Omni model card's recommended text sampling.
    return StageSampling(temperature=0.6, top_k=20, top_p=0.95)


def _talker_default() -> StageSampling:
    # transformers' Qwen3OmniMoeForConditionalGeneration.generate defaults for the Talker.
    return StageSampling(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)


def _code_predictor_default() -> StageSampling:
    # The reference samples the 15 residual codes with top-k 50, top-p 0.8 whenever the Talker samples.
    return StageSampling(temperature=1.0, top_k=50, top_p=0.8)


class Sampling(_Settings):
    """Sampling of all three token-producing stages; the reference implementation's defaults.

    The code predictor follows the Talker: when the Talker is greedy, so is the code predictor (as in the
    reference). The Talker's suppression of codec special ids (all but EOS) is not a setting: it is part
    of the model's logits processing and always applies.
    """

    thinker: StageSampling = Field(default_factory=_thinker_default)
    talker: StageSampling = Field(default_factory=_talker_default)
    code_predictor: StageSampling = Field(default_factory=_code_predictor_default)
    seed: int | None = Field(
        None,
        ge=0,
        lt=2**63,
        description="seed of the response's draws (every stage's); None: fresh per response",
    )

    def response_seed(self) -> int:
        """The seed one response draws with: `seed`, or a fresh one when it is None."""
        return secrets.randbits(62) if self.seed is None else self.seed

    @classmethod
    def greedy(cls, seed: int | None = None) -> Sampling:
        """Greedy Thinker, Talker and code predictor; the repetition penalties are kept."""
        d = cls()
        return cls(
            thinker=d.thinker.model_copy(update={"do_sample": False}),
            talker=d.talker.model_copy(update={"do_sample": False}),
            code_predictor=d.code_predictor.model_copy(update={"do_sample": False}),
            seed=seed,
        )

    @property
    def effective_code_predictor(self) -> StageSampling:
        """The code predictor's sampling as run: greedy whenever the Talker is greedy."""
        if self.talker.do_sample:
            return self.code_predictor
        return self.code_predictor.model_copy(update={"do_sample": False})


class SessionSettings(_Settings):
    """One conversation's settings; `Engine.session(**kwargs)` builds this."""

    voice: str = "ethan"
    instructions: str | None = Field(None, description="system prompt; None: no system turn")
    output_sample_rate: int = 24000
    sampling: Sampling = Field(default_factory=Sampling)
    max_output_tokens: int = Field(1024, ge=1)
    max_audio_frames: int = Field(4096, ge=1)
    truncation: Literal["auto", "disabled"] | Annotated[float, Field(gt=0.0, le=1.0)] = Field(
        "auto",
        description="when the conversation outgrows the context, drop its oldest turns (the system turn "
        "stays) down to this fraction of the input limit; 'auto': 0.75; 'disabled': a too-long turn fails",
    )
