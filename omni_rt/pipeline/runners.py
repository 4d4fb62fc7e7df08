"""The real stage runners: each owns its stage's tensors, caches and samplers; the scheduler calls them
with token ids and codes (plain ints) and gets plain ints and numpy PCM back.

Caches are allocated once, when the runners are built at engine start: one slot (row) per session in
the Thinker's and the Talker's KV caches (plus one scratch row that graph capture may write), one
Code2Wav streaming state per slot. The per-token Thinker decode and the per-frame Talker step have
shapes that depend only on the batch size (and, for the Thinker, a power-of-two bucket of the attended
cache length): with `cuda_graphs` on a CUDA device they are captured at engine start, one graph per
shape, and replayed; on the CPU (or with the switch off) the same functions run eagerly.

With `prefill_graphs` on as well, the Thinker's prefill and the Talker's prompt-prefix prefill are
graphed too: the new tokens are right-padded to a length bucket (`EngineSettings.prefill_buckets`) and
`logits_index` picks each row's last real token. The Thinker's prefill graphs take embeddings, so text
turns (embedded just before) and spoken turns (clips scattered in) share them. Padding tokens write k/v at positions at and after the
row's real length, in the row's own slot only; each of those rows is written again by the token that
really lands there before any query reads it (a query at position p reads rows <= p of its slot), so
padding never changes a result. A prefill that would pad past the cache's end runs eagerly, unpadded.

Sampling happens inside each step (graphed with it): `omni_rt.model.sampling.StageSampler` holds every
slot's settings, seed and repetition history in device tensors that the step indexes with its `slots`
input, and draws are keyed by (response seed, stage, position), so a request gets the same choices
alone or in any batch, graphed or eager, and equal to the offline loop's. A step's choices for all its
rows are read back to the host together (`host_ids`): one host sync per step, not one per row.
"""

from __future__ import annotations

from omni_rt.admission import CAPTURE_ROWS
from omni_rt.config import EngineSettings
from omni_rt.pipeline.code2wav_runner import Code2WavRunner
from omni_rt.pipeline.stage_device import LaunchGate, StageActivity, StartHandoff
from omni_rt.pipeline.talker_runner import TalkerRunner
from omni_rt.pipeline.thinker_runner import ThinkerRunner

__all__ = ["Code2WavRunner", "TalkerRunner", "ThinkerRunner", "build_runners"]


def build_runners(model, settings: EngineSettings) -> tuple[ThinkerRunner, TalkerRunner, Code2WavRunner]:
    gate = LaunchGate() if settings.prefill_launch_order and settings.talker_overlap_prefill else None
    start = StartHandoff(settings.max_sessions + CAPTURE_ROWS, model.cfg.num_code_groups, model.device)
    thinker = StageActivity()  # the Talker's frames read whether the Thinker has work on the GPU
    return (
        ThinkerRunner(model, settings, gate, start, thinker),
        TalkerRunner(model, settings, gate, start, thinker),
        Code2WavRunner(model, settings, start),
    )
