"""Audio before text: how far the Thinker may run ahead of the voice, and when Code2Wav decodes early.

Plain Python on a request's counters and the pipeline clock: the scheduler asks, the policy tests fake
the stages. A request's audio is "ahead" by the seconds of PCM sent beyond what real-time playback,
started at its first PCM, has used (`audio_ahead_s`). On a GPU the audio is seconds ahead within a few
hundred milliseconds and neither rule below changes anything after that; on a small CPU, where the three
stage threads share the cores (and one interpreter lock), they keep the playback from running dry:

- Text lead (`may_decode_text`): the Thinker decodes a request while it is at most `max_text_lead`
  tokens ahead of the Talker's frames, and at most `urgent_text_lead` while the request's audio is less
  than `audio_ahead_s` ahead (or has not started): text no one will hear for seconds waits for the audio
  that is due. The Talker reads one token per frame, so any lead of 1 or more keeps it fed. Replies of
  fixed length (the benchmark's) are held too, until their audio ends. With `text_due_lead`, a step runs
  only when some reply is due (`text_due`: at most that many tokens ahead), and takes every reply that
  may decode, so that steps carry many replies at once.
- Audio lead (`talker_may_step`, `talker_due`; off unless `talker_audio_lead_s`): the Talker makes a
  reply's frames up to that many seconds of audio ahead of its playback, and steps when some reply is
  within `talker_due_s` of it (or has no audio yet), taking then every reply below the lead. Without it
  the Talker runs as fast as its text comes, and at many conversations its steps and the Thinker's,
  which follow them token for token, carry the few replies freed since the last; with it they carry most
  (a load simulation, `scripts/sim_load.py`: 64 conversations, Thinker steps 737 -> 550, Talker steps
  663 -> 503, 2026-12-05; not measured on a GPU yet).
- Prompts first (`decode_before_prompt`; off unless `prompt_first_s`): when a new prompt waits for the
  Thinker at a decode step, the step takes only the replies whose voice runs out of text soon
  (`text_runs_dry_at`), and the prompt's prefill comes before the rest: a prompt that arrives during
  another's prefill, or during the yield to its first audio, then waits behind a step of the replies that
  need text now, not behind a step of every reply (at 64 conversations on an H200 that step was 18.5 ms).
- Deadlines (`audio_urgency`): one Code2Wav chunk at a time goes to the response whose audio runs dry
  first, a response with no audio yet before all of them; between chunks the frames that came meanwhile are
  read, so a new conversation's first chunk waits for one chunk, not for every other conversation's.
- Chunks (`chunk_to_decode`): Code2Wav decodes its planned chunk sizes (`EngineSettings.chunk_size`:
  1, 1, 2, 4, ... frames, few sizes, so few graphs) once that many frames are pending. The plan doubles a
  chunk only when its frames, coming at `chunk_plan_rate` times real time, are all there before the
  audio already out (plus the player's `playout_lead_ms`) has played: at 2 (a GPU) that is doubling
  after a second one-frame chunk (the first chunk is 57 ms of audio, the decoder holding back the rest of
  its frame); on a CPU whose frames come 1.1-1.45x real time the plan counts on the slow end, 1.1: 1, then
  ten chunks of 2, ten of 4, then 8s with a 100 ms lead (plain doubling ran the track dry for 0.1-0.7 s
  before each new size; planning for 1.25 did too whenever a neighbour took a core). The plan depends on
  the frame count alone, so a response's chunks, and so its PCM, are the same on every run. With
  `early_chunks` (on a GPU), when the audio sent would run out before the planned chunk's frames arrive
  (at the rate this response's latest frames came), it decodes a smaller planned size: the largest it can
  still wait for, or the largest pending now. Under load the frames come slower than the plan's rate
  (at 64 conversations on an H200 ~1.4x real time, not 2x), and without it replies ran dry before each
  chunk of 16.
"""

from __future__ import annotations

from omni_rt.config import EngineSettings
from omni_rt.pipeline.request import Request

PCM_RATE = 24_000  # Code2Wav's output (AudioOut.pcm, Request.samples)
FRAME_SAMPLES = PCM_RATE * 80 // 1000  # one codec frame (12.5 Hz) of PCM


def _played_through(req: Request, samples: float) -> float | None:
    """When (pipeline clock) playback in real time from `req`'s first PCM will have played `samples`;
    None before its first PCM."""
    return None if req.t_first_pcm is None else req.t_first_pcm + samples / PCM_RATE


def audio_runs_dry_at(req: Request) -> float | None:
    """When (pipeline clock) playback in real time from `req`'s first PCM will have used all the audio
    sent: its audio deadline. None before its first PCM."""
    return _played_through(req, req.samples)


def audio_ahead_s(req: Request, now: float) -> float | None:
    """Seconds of `req`'s audio sent beyond what playback in real time from its first PCM has used;
    None before its first PCM."""
    dry = audio_runs_dry_at(req)
    return None if dry is None else dry - now


def audio_urgency(req: Request, t_first_frame: float) -> tuple[int, float]:
    """Which response's audio Code2Wav decodes first (smaller first): one that has no audio yet (its first
    audio is due; among those, the oldest frame 0), then the one whose audio runs dry soonest."""
    dry = audio_runs_dry_at(req)
    return (0, t_first_frame) if dry is None else (1, dry)


def text_lead_limit(req: Request, now: float, s: EngineSettings) -> int | None:
    """The most tokens the Thinker may be ahead of `req`'s frames before its next decode; None: no limit."""
    lead = s.max_text_lead
    if lead is None or s.urgent_text_lead is None or s.urgent_text_lead >= lead:
        return lead
    ahead = audio_ahead_s(req, now)
    return s.urgent_text_lead if ahead is None or ahead < s.audio_ahead_s else lead


def text_due(req: Request, now: float, s: EngineSettings) -> bool:
    """Is `req`'s text due: does it call for a Thinker step now? With `text_due_lead`, when it may decode
    and is at most that many tokens ahead of its voice (or may decode for another reason: no limit, its
    audio over); a step then takes every reply that may decode, so at many conversations a step carries
    most of them, not the few that came free since the last. Without, whenever it may decode."""
    if not may_decode_text(req, now, s):
        return False
    due = s.text_due_lead
    if due is None or text_lead_limit(req, now, s) is None or _spoken_fixed_length(req):
        return True
    return len(req.tokens) - req.frames <= due


def may_decode_text(req: Request, now: float, s: EngineSettings) -> bool:
    """May the Thinker decode `req` now? A reply of fixed length (`ignore_eos`: the benchmark's) waits as
    every reply does while it is spoken, so that the load protocol measures the pacing that users get;
    once its audio has ended, it goes on to its length (`_spoken_fixed_length`)."""
    limit = text_lead_limit(req, now, s)
    return limit is None or len(req.tokens) - req.frames <= limit or _spoken_fixed_length(req)


def _spoken_fixed_length(req: Request) -> bool:
    """A reply of fixed length whose audio has ended (the Talker let go of it): no frame will ever let its
    text on again, so no lead holds it."""
    return req.ignore_eos and "talker" not in req.holders


def frames_run_dry_at(req: Request) -> float | None:
    """When (pipeline clock) playback in real time from `req`'s first PCM will have used all the audio of
    its frames (made by the Talker, decoded or not); None before its first PCM."""
    return _played_through(req, req.frames * FRAME_SAMPLES)


def text_runs_dry_at(req: Request) -> float | None:
    """When (pipeline clock) real-time playback from `req`'s first PCM will need a frame that waits for text
    the Thinker has not made: through every frame made, and one frame for each text token the Talker has not
    spoken yet (Talker step k reads token k, `prompt_layout.talker_text_id`). None before its first PCM."""
    return _played_through(req, max(req.frames, len(req.tokens)) * FRAME_SAMPLES)


def decode_before_prompt(req: Request, now: float, s: EngineSettings) -> bool:
    """Must `req`'s next token be decoded before a prompt that waits for the Thinker is prefilled
    (`prompt_first_s`)? When its text runs dry within `prompt_first_s`, or it has no audio yet (its first
    frames read its text as it comes); a reply of fixed length whose audio has ended never must. Without
    the setting, always (a step takes every reply that may decode)."""
    if s.prompt_first_s is None:
        return True
    if _spoken_fixed_length(req):
        return False
    dry = text_runs_dry_at(req)
    return dry is None or dry - now < s.prompt_first_s


def frames_ahead_s(req: Request, now: float) -> float | None:
    """Seconds of audio in `req`'s frames beyond what real-time playback from its first PCM has used;
    None before its first PCM."""
    dry = frames_run_dry_at(req)
    return None if dry is None else dry - now


def talker_may_step(req: Request, now: float, s: EngineSettings) -> bool:
    """May the Talker make `req`'s next frame now (its text there)? Below `talker_audio_lead_s` of audio
    ahead of its playback, or before its first PCM; always without that setting."""
    ahead = None if s.talker_audio_lead_s is None else frames_ahead_s(req, now)
    return ahead is None or ahead < s.talker_audio_lead_s


def _talker_due_lead(s: EngineSettings) -> float:
    """Audio ahead of its playback (s) below which a reply calls for a Talker step (with a lead)."""
    return min(s.talker_due_s, s.talker_audio_lead_s)


def talker_due(req: Request, now: float, s: EngineSettings) -> bool:
    """Does `req` call for a Talker step now (then every reply that `talker_may_step` goes in it)? Within
    `talker_due_s` of its playback, or before its first PCM; without `talker_audio_lead_s`, whenever it may."""
    ahead = None if s.talker_audio_lead_s is None else frames_ahead_s(req, now)
    return ahead is None or ahead < _talker_due_lead(s)


def talker_due_at(req: Request, s: EngineSettings) -> float | None:
    """When (pipeline clock) `req` comes due for a Talker step by the clock alone; None: it does not wait
    on the clock (no lead, or no audio yet)."""
    dry = None if s.talker_audio_lead_s is None else frames_run_dry_at(req)
    return None if dry is None else dry - _talker_due_lead(s)


def _planned(decoded: int, req: Request, s: EngineSettings) -> int:
    """The planned size of `req`'s next chunk after `decoded` frames (`EngineSettings.chunk_size`)."""
    # the decoder holds back the end of the latest frame (less than one): what is out is req.samples
    held = min(1.0, max(0.0, decoded - req.samples / FRAME_SAMPLES))
    return s.chunk_size(decoded, held=held)


def _chunk_choice(
    pending: int, decoded: int, ended: bool, req: Request, frame_interval_s: float | None, s: EngineSettings
) -> tuple[int, float | None]:
    """(frames, not before): decode `frames` once the pipeline clock reaches `not before` (None: at once);
    0 frames: wait for more. `chunk_to_decode` reads it at a time, `chunk_wait_until` for its time.

    Early (`early_chunks`): wait for the smallest planned size above `pending`, up to this chunk's, while
    its missing frames (one interval more: the decode, and jitter) would come before the audio sent runs
    out; from then on, decode the largest planned size pending. Small chunks cost more per frame, so they
    are used only as needed."""
    planned = _planned(decoded, req, s)
    if pending >= planned:
        return planned, None
    if ended:
        return pending, None  # the remainder at the end
    dry = audio_runs_dry_at(req)
    if not s.chunks_early or pending == 0 or frame_interval_s is None or dry is None:
        return 0, None  # (nothing plays yet: the first chunk is the plan)
    early = max((n for n in s.chunk_sizes() if n <= min(pending, planned)), default=0)
    bigger = min((n for n in s.chunk_sizes() if pending < n <= planned), default=None)
    if not early or bigger is None:
        return early, None
    return early, dry - (bigger - pending + 1) * frame_interval_s


def chunk_to_decode(
    pending: int, decoded: int, ended: bool, req: Request, frame_interval_s: float | None, now: float,
    s: EngineSettings,
) -> int:  # fmt: skip
    """Frames to decode now from `pending` (0: wait for more). `decoded`: frames decoded so far;
    `frame_interval_s`: the mean time between this response's latest frames (None: fewer than two).
    Planned sizes, or early ones (`_chunk_choice`); a wait that ends by the clock, not by a frame, ends at
    `chunk_wait_until`."""
    frames, not_before = _chunk_choice(pending, decoded, ended, req, frame_interval_s, s)
    return frames if not_before is None or now >= not_before else 0


def chunk_wait_until(
    pending: int, decoded: int, ended: bool, req: Request, frame_interval_s: float | None, s: EngineSettings
) -> float | None:
    """When (pipeline clock) `chunk_to_decode` stops waiting for frames that have not come: the audio
    would run dry before a bigger chunk's frames, so it decodes what is pending. None: it does not wait on
    the clock. The Code2Wav thread sleeps until the earliest of these, or a message: with frames slowed or
    stopped (a burst of other conversations' prefills), nothing else would wake it in time."""
    return _chunk_choice(pending, decoded, ended, req, frame_interval_s, s)[1]
