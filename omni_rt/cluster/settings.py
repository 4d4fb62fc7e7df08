"""What a cluster deployment is: the model, how many replicas (or their autoscaling bounds), what each
replica admits and asks of Ray, and the one public endpoint. Plain data, no Ray import: the command line
and `serve run`'s app builder both build one and it travels to every replica.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from omni_rt.server.app import TINY_REPLY_SECONDS, normalize_origin
from omni_rt.server.webrtc import ice_server

CODEC_FRAME_S = 0.08  # one Talker frame of audio


@dataclass(frozen=True)
class ClusterSettings:
    model: str = "tiny"
    device: str | None = None  # None: the engine's choice (cuda where a GPU is given, else cpu)
    dtype: str | None = None
    max_sessions: int = 4  # per replica: engine slots, and the most conversations Serve routes to it
    replicas: int = 1  # fixed count, unless autoscale is set
    autoscale: tuple[int, int] | None = None  # (min, max) replicas
    # Sessions in use per replica that autoscaling aims at; below max_sessions, so that a new replica is
    # starting (minutes for a 30B checkpoint) before the running ones are full. None: 3/4 of max_sessions.
    target_sessions: float | None = None
    num_gpus: float | None = None  # per replica; None: 0 for tiny, else 1
    num_cpus: float = 1.0  # per replica (Ray's accounting; the engine's threads are torch_threads)
    torch_threads: int = 1  # intra-op threads of a replica's torch (CPU replicas share a node's cores)
    # Draining (scale down, redeploy): a replica takes no new conversations and keeps its running ones up
    # to this long before it is stopped; those still running then get an error event and a close.
    grace_s: float = 30.0
    host: str = "127.0.0.1"  # the public endpoint (the ingress)
    port: int = 8080  # 0: any free port (tests)
    token: str | None = None
    allowed_origins: Sequence[str] = ()
    ice_servers: Sequence[str] = ()
    voice: str = "ethan"
    max_audio_seconds: float | None = None  # None: 8 s for tiny, 60 s for checkpoints (as omni-rt serve)
    idle: str = "silence"
    app_name: str = "omni_rt"
    extra: Mapping[str, Any] = field(default_factory=dict)  # more EngineSettings fields for Engine.load

    def __post_init__(self) -> None:
        def bad(message: str) -> None:
            raise ValueError(f"cluster settings: {message}")

        if self.max_sessions < 1:
            bad("max_sessions must be at least 1")
        if self.autoscale is None and self.replicas < 1:
            bad("replicas must be at least 1")
        if self.autoscale is not None:
            low, high = self.autoscale
            if not 0 <= low <= high or high < 1:
                bad(f"autoscale must be MIN,MAX with 0 <= MIN <= MAX and MAX >= 1, not {low},{high}")
        if self.target_sessions is not None and not 0 < self.target_sessions <= self.max_sessions:
            bad("target_sessions must be in (0, max_sessions]")
        if self.num_gpus is not None and self.num_gpus < 0:
            bad("num_gpus must be >= 0")
        if self.torch_threads < 1:
            bad("torch_threads must be at least 1")
        if self.grace_s < 0:
            bad("grace_s must be >= 0")
        if not 0 <= self.port < 65536:
            bad("port must be 0..65535")
        if self.idle not in ("silence", "nothing"):
            bad("idle must be silence or nothing")
        if self.max_audio_seconds is not None and self.max_audio_seconds <= 0:
            bad("max_audio_seconds must be positive")
        for origin in self.allowed_origins:
            normalize_origin(origin)  # ValueError names the bad one
        for url in self.ice_servers:
            ice_server(url)

    @property
    def gpus(self) -> float:
        if self.num_gpus is not None:
            return self.num_gpus
        return 0.0 if self.model == "tiny" else 1.0

    @property
    def audio_frames(self) -> int:
        seconds = self.max_audio_seconds
        if seconds is None:
            seconds = TINY_REPLY_SECONDS if self.model == "tiny" else 60.0
        return max(1, round(seconds / CODEC_FRAME_S))

    @property
    def target(self) -> float:
        return (
            self.target_sessions if self.target_sessions is not None else max(1.0, 0.75 * self.max_sessions)
        )

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> ClusterSettings:
        """From `serve run omni_rt.cluster:build_app key=value ...` (strings) or a config file's
        `args:` (typed): `autoscale=1,4`, `allowed_origins=a,b`; unknown keys are an error."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ValueError(f"cluster settings: unknown {', '.join(unknown)}; known: {', '.join(known)}")
        values: dict[str, Any] = {}
        for key, value in args.items():
            values[key] = _parse(key, value) if isinstance(value, str) else value
        if isinstance(values.get("autoscale"), list):
            values["autoscale"] = tuple(values["autoscale"])
        return cls(**values)


_INTS = {"max_sessions", "replicas", "torch_threads", "port"}
_FLOATS = {"target_sessions", "num_gpus", "num_cpus", "grace_s", "max_audio_seconds"}
_LISTS = {"allowed_origins", "ice_servers"}


def _parse(key: str, value: str) -> Any:
    try:
        if key in _INTS:
            return int(value)
        if key in _FLOATS:
            return float(value)
    except ValueError:
        raise ValueError(f"cluster settings: {key} must be a number, not {value!r}") from None
    if key in _LISTS:
        return tuple(v for v in value.split(",") if v)
    if key == "autoscale":
        return parse_autoscale(value)
    if key == "extra":
        raise ValueError("cluster settings: extra is given in a config file's args, not on the command line")
    return value


def parse_autoscale(value: str) -> tuple[int, int]:
    """`MIN,MAX` as the command line writes it."""
    low, sep, high = value.partition(",")
    try:
        if not sep:
            raise ValueError
        return int(low), int(high)
    except ValueError:
        raise ValueError(f"autoscale must be MIN,MAX (two integers), not {value!r}") from None
