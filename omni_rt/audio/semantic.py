"""`semantic_vad`: Silero finds the pauses, Smart Turn v3 decides whether a pause ends the turn.

    vad = SemanticVad(SemanticVadConfig(eagerness="auto"))
    for ev in vad.push(chunk): ...            # the same events as ServerVad
    seg = TurnSegmenter(SemanticVadConfig())  # turns, as with server_vad

Speech starts exactly as with `server_vad` (`omni_rt.audio.vad`). When the voice pauses for `pause_ms`,
the end-of-turn model hears the turn so far (its last 8 s) and gives the probability that the speaker
has finished: a complete sentence ends the turn there, a sentence cut off ("I'd like to order a ...")
keeps it open until speech resumes or the silence reaches the eagerness' maximum wait. The model is asked
once per pause: the silence after it adds nothing it could use.

Eagerness, as OpenAI documents `semantic_vad`: `low` waits longer for the user to go on, `high` answers
sooner, `auto` is `medium`; the longest waits are 8 s, 4 s and 2 s. The probability a pause needs to end
the turn is ours (OpenAI does not publish its own): 0.7, 0.5 and 0.3, with 0.5 Smart Turn's own
decision point.

The model is Smart Turn v3.2 by Daily (pipecat-ai/smart-turn, BSD 2-Clause licence, open weights), a
Whisper-tiny encoder with a classification head, run from the ONNX file that ships in the `pipecat-ai`
wheel (`pipecat/audio/turn/smart_turn/data/`); pipecat itself is never imported. It takes 80-bin Whisper
log-mel features of 8 s of 16 kHz audio, left-padded with zeros, the waveform normalised to zero mean
and unit variance first, as its training did.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from omni_rt.audio.features import log_mel
from omni_rt.audio.onnx import onnx_session, packaged_file
from omni_rt.audio.vad import FRAME_MS, FRAME_SAMPLES, SAMPLE_RATE, ServerVad, SpeechStopped, VadConfig

__all__ = ["EAGERNESS", "SemanticVad", "SemanticVadConfig", "SmartTurn"]

Eagerness = Literal["low", "medium", "high", "auto"]
# eagerness -> (probability of "finished" that ends the turn at a pause, longest wait in ms)
EAGERNESS: dict[str, tuple[float, int]] = {
    "low": (0.7, 8000),
    "medium": (0.5, 4000),
    "high": (0.3, 2000),
    "auto": (0.5, 4000),
}


@functools.lru_cache(maxsize=1)
def _worker() -> ThreadPoolExecutor:
    """The threads every offloaded SemanticVad shares (onnxruntime releases the GIL while it runs)."""
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="smart-turn")


class SmartTurn:
    """Smart Turn v3: `p = model(audio)`, the probability that the speech in `audio` (16 kHz) is finished."""

    WINDOW = 8 * SAMPLE_RATE
    FILE = ("pipecat-ai", "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx")

    def __init__(self) -> None:
        self._session = onnx_session(packaged_file(*self.FILE))

    def __call__(self, audio: np.ndarray) -> float:
        (prob,) = self._session.run(None, {"input_features": self.features(audio)[None]})
        return float(np.asarray(prob).reshape(-1)[0])

    @classmethod
    def features(cls, audio: np.ndarray) -> np.ndarray:
        """What the model hears of `audio`: [80, 800] log-mels of its last 8 s, zero-padded at the start."""
        x = np.asarray(audio, dtype=np.float32)[-cls.WINDOW :]
        x = np.pad(x, (cls.WINDOW - len(x), 0))  # the model hears the end of the turn at its end
        x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
        return log_mel(x, n_mels=80).numpy()  # [80, 800]


@dataclass(frozen=True)
class SemanticVadConfig:
    """OpenAI Realtime `turn_detection` of type semantic_vad, plus the detector's own tuning."""

    eagerness: Eagerness = "auto"
    prefix_padding_ms: int = 300
    threshold: float = 0.5  # Silero's speech probability, as for server_vad
    min_speech_ms: int = 64
    release: float = 0.15
    pause_ms: int = 160  # silence after which the end-of-turn model is asked
    # True: the model runs on a worker thread and its answer applies on the first frame (or `poll`)
    # after it arrives, so the caller's thread (a server's event loop) never waits for it; False: in
    # `push`, deterministic on the audio timeline
    offload: bool = False

    sample_rate: ClassVar[int] = SAMPLE_RATE
    frame_ms: ClassVar[int] = FRAME_MS

    def __post_init__(self) -> None:
        from omni_rt.errors import ConfigError

        if self.eagerness not in EAGERNESS:
            raise ConfigError(f"eagerness must be one of {sorted(EAGERNESS)}, got {self.eagerness!r}")
        if not isinstance(self.pause_ms, int) or not FRAME_MS <= self.pause_ms <= self.max_wait_ms:
            raise ConfigError(f"pause_ms must be in [{FRAME_MS}, {self.max_wait_ms}], got {self.pause_ms!r}")
        self.vad_config()  # the Silero settings are validated as server_vad's

    @property
    def completion_threshold(self) -> float:
        return EAGERNESS[self.eagerness][0]

    @property
    def max_wait_ms(self) -> int:
        return EAGERNESS[self.eagerness][1]

    @property
    def frame_samples(self) -> int:
        return FRAME_SAMPLES

    @property
    def silence_duration_ms(self) -> int:
        """The longest silence a turn survives (what bounds the audio kept after speech)."""
        return self.max_wait_ms

    def vad_config(self) -> VadConfig:
        return VadConfig(
            threshold=self.threshold,
            prefix_padding_ms=self.prefix_padding_ms,
            silence_duration_ms=self.max_wait_ms,
            min_speech_ms=self.min_speech_ms,
            release=self.release,
        )

    def detector(self) -> SemanticVad:
        return SemanticVad(self)


class SemanticVad(ServerVad):
    """A `ServerVad` whose turns end when Smart Turn says the speech is finished (or the wait runs out)."""

    def __init__(self, cfg: SemanticVadConfig | None = None) -> None:
        self.semantic = cfg or SemanticVadConfig()
        super().__init__(self.semantic.vad_config())
        self._turn_model: SmartTurn | None = None
        self._pause_frames = -(-self.semantic.pause_ms // FRAME_MS)
        self._max_frames = -(-self.semantic.max_wait_ms // FRAME_MS)

    def load(self) -> None:
        super().load()
        if self._turn_model is None:
            self._turn_model = SmartTurn()

    def reset(self) -> None:
        super().reset()
        self._recent = np.zeros(SmartTurn.WINDOW, np.float32)  # the last 8 s analysed, oldest first
        self._asked = False  # whether this pause was put to the model already
        self._answer: Future | None = None  # the model's answer being computed off this thread
        self.last_completion: float | None = None  # the model's last answer

    def _heard(self, frame: np.ndarray) -> None:
        self._recent = np.concatenate((self._recent[FRAME_SAMPLES:], frame))

    def _voiced(self) -> None:
        self._asked = False  # the pause is over: the next one is put to the model afresh
        self._answer = None  # and an answer about this one no longer counts

    @property
    def pending(self) -> Future | None:
        return self._answer

    def poll(self) -> SpeechStopped | None:
        if self._in_speech and self._run and self._answer is not None and self._answer.done():
            return self._stop() if self._turn_over(self._run) else None
        return None

    def _turn_over(self, silent_frames: int) -> bool:
        if self._answer is not None and self._answer.done():
            answer, self._answer = self._answer, None
            self.last_completion = answer.result()
            if self.last_completion >= self.semantic.completion_threshold:
                return True
        if not self._asked and silent_frames >= self._pause_frames:
            self._asked = True
            if self._turn_model is None:
                self.load()
            assert self._turn_model is not None
            # The turn up to the end of its voice, not what came before it nor the silence since: the
            # model reads silence at the end as finality (on a cut-off sentence too), so it hears the
            # pause as it was trained to, the speech ending at the end of its window.
            since_voice = (self.elapsed_ms - self._speech_end_ms) * SAMPLE_RATE // 1000
            turn_samples = (self._speech_end_ms - self.turn_start_ms) * SAMPLE_RATE // 1000
            voiced = self._recent[: len(self._recent) - since_voice]
            audio = voiced[-min(turn_samples, SmartTurn.WINDOW) :]
            if self.semantic.offload:
                self._answer = _worker().submit(self._turn_model, audio)
            else:
                self.last_completion = self._turn_model(audio)
                if self.last_completion >= self.semantic.completion_threshold:
                    return True
        return silent_frames >= self._max_frames
