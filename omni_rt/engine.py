"""Engine: loads a model, owns the background pipeline, admits sessions.

    engine = omni_rt.Engine.load("tiny")              # CPU, seeded random weights
    async with engine:                                # builds the stage runners, starts their threads
        async with engine.session(voice="ethan") as s:
            async for ev in s.respond("Hello!"):
                ...

Model work runs in the pipeline's threads, never on the caller's event loop. Caches are allocated when
the engine starts (one slot per session, `EngineSettings.max_sessions`) and dropped when it stops.
Admission (omni_rt.admission): beyond `max_sessions` a session is refused at once with
`SessionLimitError`, or waits its turn for up to `admission_wait_s`; `kv_cache_gib` caps the caches'
memory at load. Sessions reach the engine only through a `SessionHost` (omni_rt.host).
"""

from __future__ import annotations

import asyncio
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import ValidationError

from omni_rt import collector
from omni_rt.admission import Capacity, Slots, check_kv_ceiling, kv_bytes_per_slot, kv_cache_bytes
from omni_rt.config import EngineSettings, Sampling, SessionSettings
from omni_rt.errors import ConfigError, EngineClosedError, EngineStalledError, InvalidRequestError
from omni_rt.model.config import PRESETS, OmniConfig, load_hf_config, preset
from omni_rt.pipeline.request import Request
from omni_rt.pipeline.scheduler import Pipeline
from omni_rt.session import Session
from omni_rt.turn_input import check_sample_rate

# builds (thinker, talker, code2wav) stage runners at engine start
StageFactory = Callable[[EngineSettings], tuple[Any, Any, Any]]


def _checkpoint_tokenizer(directory: Path, cfg: OmniConfig):
    """The checkpoint's tokenizer; a directory without one (a test checkpoint from `save_pretrained`)
    gets the byte-level tiny tokenizer at the same special ids, with a warning: `respond(input_ids=...)`
    is then exact and text deltas are bytes."""
    from omni_rt.tokenizer import Tokenizer

    if any((directory / f).is_file() for f in ("tokenizer.json", "vocab.json")):
        return Tokenizer.from_checkpoint(directory, cfg.ids)
    warnings.warn(f"{directory} has no tokenizer files: using the byte-level tiny tokenizer", stacklevel=3)
    return Tokenizer.tiny(cfg.ids)


def triton_runs(device: Any) -> bool:
    """Whether the Triton kernels can run for a model on `device` (compiled: a CUDA device and Triton)."""
    if device.type != "cuda":
        return False
    try:
        from omni_rt.kernels.moe_decode import triton_available
    except ImportError as e:  # a source checkout without the omni_rt/kernels link, or no Triton
        warnings.warn(f"the Triton kernels are not importable ({e}); plain PyTorch instead", stacklevel=3)
        return False
    return triton_available()


def _check_fits_in_memory(cfg: OmniConfig, dtype: Any, name: str) -> None:
    """A model whose weights alone outgrow this machine's free memory is a ConfigError before the build
    (the build would take minutes and end in an out-of-memory kill or a raw traceback)."""
    from omni_rt.model.omni import OmniModel

    meta = OmniModel.build(cfg, device="meta", dtype=dtype)  # shapes only: nothing is allocated
    need = sum(p.numel() for p in meta.parameters()) * dtype.itemsize
    free = _available_memory()
    if free is not None and need > free:
        gb = 1024**3
        raise ConfigError(
            f"{name} in {str(dtype).removeprefix('torch.')} needs {need / gb:.0f} GB for its weights and "
            f"this machine has {free / gb:.0f} GB free: use a GPU (device='cuda'), a smaller dtype, or "
            "the 'tiny' preset"
        )


def _available_memory() -> int | None:
    """Bytes of memory free for a new allocation (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class KernelChoice(NamedTuple):
    """The fast-path pieces installed on a model from outside (`apply_kernels`)."""

    moe: bool  # Triton MoE decode kernel
    moe_prefill: bool  # Triton MoE prefill kernel (rides with the decode kernel)
    fused: bool  # fused Triton kernels (RMSNorm, q/k norm + RoPE + cache, router, decode attention, ...)
    packed: bool  # packed projections (one GEMM for q/k/v and for gate/up; plain PyTorch)
    programmatic_launch: bool  # every fused code frame's kernels as programmatic dependent launches


def kernel_choice(settings: EngineSettings, device: Any) -> KernelChoice:
    """What `settings` give a model on `device` ("auto"/None: the Triton kernels where Triton runs on a
    CUDA device, packed projections on any CUDA device); a ConfigError when a setting demands Triton
    kernels where they cannot run."""
    runs = triton_runs(device)

    def wanted(value: bool | None, where: bool) -> bool:
        return bool(value) or (value is None and where)

    moe = settings.moe_backend == "triton" or (settings.moe_backend == "auto" and runs)
    choice = KernelChoice(
        moe=moe,
        moe_prefill=moe and wanted(settings.moe_prefill_kernel, runs),
        fused=wanted(settings.fused_kernels, runs),
        packed=wanted(settings.packed_projections, device.type == "cuda"),
        programmatic_launch=settings.programmatic_launch == "always",  # 'idle': the Talker's runner
    )
    demanded = [
        name
        for name, on in (
            ("moe_backend='triton'", settings.moe_backend == "triton"),
            ("moe_prefill_kernel=True", settings.moe_prefill_kernel is True),
            ("fused_kernels=True", settings.fused_kernels is True),
        )
        if on
    ]
    if demanded and not runs:
        try:  # the interpreter (TRITON_INTERPRET=1) still runs them on a CPU
            from omni_rt.kernels.moe_decode import triton_available

            ok = triton_available()
        except ImportError:
            ok = False
        if not ok:
            raise ConfigError(
                f"{', '.join(demanded)}: cannot use the Triton kernels here (needs Triton and a CUDA device)"
            )
    return choice


def apply_kernels(omni: Any, settings: EngineSettings) -> KernelChoice:
    """Install on `omni` exactly the fast-path pieces `settings` ask for, removing any others (a model
    shared by engines of different settings, as in the benchmark); call before graphs are captured,
    which keep whatever launches they recorded. Returns `kernel_choice`."""
    choice = kernel_choice(settings, omni.device)
    try:
        if choice.moe:
            from omni_rt.kernels import moe_decode

            moe_decode.install(omni, "triton", prefill_kernel=choice.moe_prefill)
        else:
            for m in omni.modules():
                if hasattr(m, "experts_fn"):
                    m.experts_fn = None  # back to the module's own impl
        if choice.fused:
            from omni_rt.kernels import fused as fused_kernels

            names = [k for k in fused_kernels.KERNELS if k != "code2wav" or settings.fused_code2wav]
            fused_kernels.uninstall_all(omni)  # none left from an engine of other settings sharing the model
            fused_kernels.install_all(omni, names, programmatic_launch=choice.programmatic_launch)
        elif "omni_rt.kernels.fused" in sys.modules:  # never imported: nothing of it can be installed
            sys.modules["omni_rt.kernels.fused"].uninstall_all(omni)
        omni.fused_sampling = choice.fused  # the stage samplers read it (model/sampling.StageSampler)
        if choice.packed:
            from omni_rt.kernels import packed

            packed.install_packed(omni)
        elif "omni_rt.kernels.packed" in sys.modules:
            sys.modules["omni_rt.kernels.packed"].uninstall_packed(omni)
    except (ImportError, RuntimeError) as e:
        raise ConfigError(f"cannot use the Triton kernels here: {e}") from None
    return choice


class Engine:
    def __init__(
        self,
        cfg: OmniConfig,
        tokenizer: Any,
        stages: StageFactory,
        settings: EngineSettings | None = None,
        model: Any = None,
        name: str = "custom",
    ) -> None:
        """Prefer `Engine.load(...)`. `stages` builds the runners at start (tests pass fake ones)."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.settings = settings or EngineSettings()
        kind = getattr(getattr(model, "device", None), "type", None)  # a torch.device's "cpu", "cuda"
        if isinstance(kind, str):
            # the defaults that depend on where the model runs (chunk plan, playout lead, Code2Wav
            # batching), here for Engine.load's engines and for those around an already built model
            # alike (the bench's later rows and load variants)
            self.settings = self.settings.for_device(kind)
        self.model = model
        self.name = name
        self._stages = stages
        self._pipeline: Pipeline | None = None
        self._lifecycle = asyncio.Lock()  # start and stop run one at a time, in the order called
        self._scopes = 0  # `async with engine:` blocks under way
        # the caches' items: the model's dtype, or float32 (the CPU's) for stages made without a model
        self._kv_itemsize = model.dtype.itemsize if model is not None else 4
        check_kv_ceiling(cfg, self.settings, self._kv_itemsize)
        self._slots = Slots(self.settings.max_sessions, self.settings.admission_wait_s)
        self._generation = 0  # runs of the pipeline so far: each start has new, empty caches
        self._host = _Host(self)
        self._speech_worker: Any = None  # made at the first live turn (omni_rt.live_speech)
        self._holds_collector = False  # omni_rt.collector's freeze, from start to stop

    # -- loading ---------------------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        model: str | Path = "tiny",
        *,
        device: str = "cpu",
        dtype: str | None = None,
        random_weights: bool = False,
        seed: int = 0,
        settings: EngineSettings | None = None,
        **overrides: Any,
    ) -> Engine:
        """A preset name (`tiny`, `qwen3-omni-30b-a3b`) or a Hugging Face checkpoint directory.

        `tiny` always has seeded random weights; other presets need `random_weights=True` (they have no
        checkpoint here). dtype defaults to float32 on the CPU and bfloat16 elsewhere. Keyword overrides
        go to `EngineSettings` (e.g. `max_sessions=8`, `yield_to_talker_ms=0`).
        """
        import torch  # the engine's import path stays light until a model is actually loaded

        from omni_rt.model.omni import OmniModel
        from omni_rt.tokenizer import Tokenizer

        if overrides or settings is None:
            try:  # validated as a whole: a misspelt or out-of-range override is an error, not dropped
                settings = EngineSettings.model_validate(
                    (settings.model_dump() if settings else {}) | overrides
                )
            except ValidationError as e:
                raise ConfigError(f"bad engine settings: {e}") from None
        name = str(model)
        if name in PRESETS:
            cfg = preset(name)
            if name != "tiny" and not random_weights:
                raise ConfigError(
                    f"preset {name!r} has no weights here: pass a checkpoint directory, or random_weights=True"
                )
            weights: Any = "random"
            tokenizer = Tokenizer.tiny(cfg.ids)
        elif Path(name).is_dir():
            cfg = load_hf_config(name)
            weights = "random" if random_weights else name
            tokenizer = _checkpoint_tokenizer(Path(name), cfg)
        else:
            raise ConfigError(f"unknown model {name!r}: a preset {list(PRESETS)} or a checkpoint directory")
        try:
            kind = torch.device(device).type
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"unknown device {device!r}: {e}") from None
        if kind == "cuda" and not torch.cuda.is_available():
            why = "this PyTorch was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise ConfigError(f"device {device!r}: CUDA is not available here ({why}); use device='cpu'")
        dtype = dtype or ("float32" if kind == "cpu" else "bfloat16")
        resolved = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype), None)
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise ConfigError(
                f"dtype must name a floating-point torch dtype (float32, bfloat16, ...), got {dtype!r}"
            )
        check_kv_ceiling(cfg, settings, resolved.itemsize)  # before the build, which takes minutes
        if kind == "cpu":
            _check_fits_in_memory(cfg, resolved, name)
        # a kernel the settings demand where it cannot run: fail before the build, not after
        kernel_choice(settings, torch.device(device))
        layers_impl = settings.moe_backend  # "auto"/"plain"/"triton": layers.py's own choice underneath
        omni = OmniModel.build(
            cfg, device=device, dtype=dtype, weights=weights, seed=seed,
            moe_impl="auto" if layers_impl in ("auto", "plain", "triton") else layers_impl,
        )  # fmt: skip
        apply_kernels(omni, settings)  # before the runners capture graphs

        def stages(s: EngineSettings):
            from omni_rt.pipeline.runners import build_runners

            return build_runners(omni, s)

        return cls(cfg, tokenizer, stages, settings, model=omni, name=name)

    # -- lifecycle -------------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._pipeline is not None and self._pipeline.running

    async def start(self) -> None:
        async with self._lifecycle:
            if self.running:
                return
            # building runners allocates the caches: off the event loop
            thinker, talker, code2wav = await asyncio.to_thread(self._stages, self.settings)
            self._pipeline = Pipeline(
                thinker, talker, code2wav, self.settings, self.cfg.ids, thread_init=self._stage_thread_init()
            )
            self._pipeline.start()
            self._generation += 1
            if self.settings.freeze_collector and not self._holds_collector:
                collector.hold()
                self._holds_collector = True

    def _stage_thread_init(self) -> Callable[[], None] | None:
        """What each stage thread runs first: on the CPU, its torch intra-op thread count
        (`EngineSettings.cpu_stage_threads`). A thread that has already run torch keeps its own count, but
        torch also takes it as the default of threads that have not yet: an app that wants another count
        in a new thread sets it there."""
        n = self.settings.cpu_stage_threads
        if n is None or self.model is None or self.model.device.type != "cpu":
            return None
        import torch

        return lambda: torch.set_num_threads(n)

    async def stop(self) -> None:
        """Stop the stage threads (in-flight responses end failed) and drop the caches."""
        async with self._lifecycle:
            p, self._pipeline = self._pipeline, None
            if p is not None:
                await asyncio.to_thread(p.stop)
                p.thinker = p.talker = p.code2wav = None  # the runners hold the caches
            if self._holds_collector:
                collector.release()
                self._holds_collector = False

    async def __aenter__(self) -> Engine:
        self._scopes += 1
        try:
            await self.start()
        except BaseException:
            self._scopes -= 1
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        # the last `async with` block to end stops it: an inner or overlapping block (a helper given the
        # engine) ending first would fail every response the others have in flight
        self._scopes -= 1
        if self._scopes == 0:
            await self.stop()

    @property
    def pipeline(self) -> Pipeline | None:
        """The running pipeline (its `steps` and `yields` logs are what the benchmark reads)."""
        return self._pipeline

    @property
    def stall(self) -> EngineStalledError | None:
        """Set when a stage call has not returned for `EngineSettings.stall_timeout_s`: the device stopped
        making progress, every response in flight ended with this error and new ones are refused; the
        process must be restarted (pipeline/watchdog.py). None while the engine is healthy."""
        return self._pipeline.stall if self._pipeline is not None else None

    @property
    def speech_worker(self) -> Any:
        """The thread that encodes live speech for every session (`omni_rt.live_speech`); None when the
        model has no audio encoder or `encode_while_speaking` is off."""
        encoder = getattr(getattr(self.model, "thinker", None), "audio_tower", None)
        if encoder is None or not self.settings.encode_while_speaking:
            return None
        if self._speech_worker is None:
            from omni_rt.live_speech import SpeechWorker

            self._speech_worker = SpeechWorker(encoder)
        return self._speech_worker

    # -- sessions --------------------------------------------------------------------------------------

    def speaker_id(self, voice: str) -> int:
        if not isinstance(voice, str):  # the config's lookup would fail with an AttributeError
            raise InvalidRequestError(f"voice must be a str, got {type(voice).__name__}")
        try:
            return self.cfg.speaker_id(voice)
        except KeyError as e:
            raise InvalidRequestError(str(e.args[0])) from None

    def session(
        self,
        voice: str = "ethan",
        instructions: str | None = None,
        output_sample_rate: int = 24000,
        sampling: Sampling | None = None,
        **kwargs: Any,
    ) -> Session:
        """Open a conversation; it holds one cache slot from its admission until it is closed.

        Bad settings raise InvalidRequestError. With every slot taken, `SessionLimitError` (code
        `session_limit`) at once; or, where `EngineSettings.admission_wait_s` > 0, the session is
        queued (first come, first served) and admitted when another closes: `async with` (or its first
        `respond()`) waits for that, up to `admission_wait_s` from this call, then raises
        SessionLimitError. Cancelling the wait, or closing the session, gives its place back."""
        if not self.running:
            raise EngineClosedError("the engine is not running: use `async with engine:`")
        speaker = self.speaker_id(voice)
        check_sample_rate(output_sample_rate)
        try:
            settings = SessionSettings(
                voice=voice,
                instructions=instructions,
                output_sample_rate=output_sample_rate,
                sampling=sampling or Sampling(),
                **kwargs,
            )
        except ValueError as e:
            raise InvalidRequestError(f"bad session settings: {e}") from None
        if instructions:  # tokenized at the first turn; text the tokenizer refuses fails here, not every turn
            try:
                self.tokenizer.encode(instructions)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"bad session settings: instructions: {e}") from None
        return Session(self._host, self._slots.request(), settings, speaker)

    @property
    def capacity(self) -> Capacity:
        """Sessions admitted and waiting, the ceiling, and the caches' bytes (per slot and in all)."""
        itemsize, s = self._kv_itemsize, self.settings
        return Capacity(
            sessions=self._slots.in_use,
            max_sessions=s.max_sessions,
            waiting=self._slots.waiting,
            kv_bytes_per_slot=kv_bytes_per_slot(self.cfg, s, itemsize),
            kv_bytes=kv_cache_bytes(self.cfg, s, itemsize),
        )


class _Host:
    """The engine as its sessions see it (omni_rt.host.SessionHost): a narrow view, so the Session
    never reaches into the Engine or the pipeline."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.settings = engine.settings
        self.tokenizer = engine.tokenizer
        self.ids = engine.cfg.ids
        self.vocab_size = engine.cfg.thinker.vocab_size
        self.audio_window = int(engine.cfg.audio_config.get("n_window", 50))
        self.speaker_id = engine.speaker_id

    @property
    def running(self) -> bool:
        return self._engine.running

    @property
    def generation(self) -> int:
        return self._engine._generation

    @property
    def speech_worker(self) -> Any:
        return self._engine.speech_worker

    def submit(self, req: Request) -> None:
        p = self._engine.pipeline
        if p is None:
            raise EngineClosedError("the engine is not running: use `async with engine:`")
        p.submit(req)

    def cancel(self, req: Request) -> None:
        if (p := self._engine.pipeline) is not None:
            p.cancel(req)

    def fail(self, req: Request, exc: Exception) -> None:
        if (p := self._engine.pipeline) is not None:
            p.fail(req, exc)
