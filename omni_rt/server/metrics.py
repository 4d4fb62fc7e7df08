"""Prometheus metrics of one engine's sessions: what `/metrics` serves, alone or as a cluster replica.

`MeteredEngine` wraps a started `Engine` at its public surface (`session()`, `Session.respond()`), so
neither the peer nor the session knows it is being measured: every reply's events pass through it on the
way to the caller. Per reply it records the time to first audio, the voice-to-voice time of a reply to
speech, and playback lateness as the load protocol defines it (`shared/reference/performance.md`):
playback starts at the first audio delta and each delta is due once the audio before it has played; a
reply is late when a delta arrives more than `LATE_MS` after it was due.

Needs `prometheus-client` (the `server` and `ray` extras).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

LATE_MS = 20.0  # an audible gap at 20 ms frames
# First audio: tens of ms on an H200 alone, seconds when overloaded or on a CPU.
LATENCY_BUCKETS_MS = (10, 20, 30, 40, 60, 80, 100, 150, 200, 300, 500, 750, 1000, 2000, 5000, 10000)


class EngineMetrics:
    """The metric families of one engine, in their own registry (a process may hold several engines)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.sessions = Gauge("omni_rt_sessions", "Sessions open now", registry=r)
        self.max_sessions = Gauge("omni_rt_max_sessions", "Sessions this engine admits", registry=r)
        self.responses = Counter("omni_rt_responses", "Replies finished, by status", ["status"], registry=r)
        self.ttfa = Histogram(
            "omni_rt_ttfa_ms", "Time to first audio of a reply, ms", buckets=LATENCY_BUCKETS_MS, registry=r
        )
        self.voice_to_voice = Histogram(
            "omni_rt_voice_to_voice_ms",
            "First audio of a reply to speech, ms from the committed turn (the VAD's silence window "
            "comes before it)",
            buckets=LATENCY_BUCKETS_MS,
            registry=r,
        )
        self.late = Counter(
            "omni_rt_late_replies", f"Replies whose audio ran dry for more than {LATE_MS:g} ms", registry=r
        )
        self.audio_seconds = Counter("omni_rt_audio_seconds", "Reply audio produced, s", registry=r)

    def exposition(self) -> tuple[bytes, str]:
        """The Prometheus text format of every family, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MeteredEngine:
    """An `Engine` whose sessions report to `metrics`; every other attribute is the engine's own."""

    def __init__(self, engine: Any, metrics: EngineMetrics) -> None:
        self._engine = engine
        self.metrics = metrics
        max_sessions = getattr(getattr(engine, "settings", None), "max_sessions", None)
        if max_sessions is not None:
            metrics.max_sessions.set(max_sessions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @contextlib.asynccontextmanager
    async def session(self, **kwargs: Any) -> AsyncIterator[_MeteredSession]:
        async with self._engine.session(**kwargs) as session:
            self.metrics.sessions.inc()
            try:
                yield _MeteredSession(session, self.metrics)
            finally:
                self.metrics.sessions.dec()


class _MeteredSession:
    def __init__(self, session: Any, metrics: EngineMetrics) -> None:
        self._session = session
        self._metrics = metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    async def respond(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        spoken = kwargs.get("audio") is not None
        playback = _Playback()
        async for ev in self._session.respond(*args, **kwargs):
            if ev.type == "response.output_audio.delta":
                playback.arrived(len(ev.pcm) / ev.sample_rate)
            elif ev.type == "response.done":
                self._record(ev, spoken, playback)
            yield ev

    def _record(self, done: Any, spoken: bool, playback: _Playback) -> None:
        m = self._metrics
        m.responses.labels(done.status).inc()
        ttfa = done.metrics.ttfa_ms
        if ttfa is not None:
            m.ttfa.observe(ttfa)
            if spoken:
                m.voice_to_voice.observe(ttfa)
        if playback.lateness_ms > LATE_MS:
            m.late.inc()
        m.audio_seconds.inc(playback.audio_s)


class _Playback:
    """A client that plays each delta as it arrives, in real time: how far behind did it fall?"""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.start: float | None = None
        self.audio_s = 0.0  # audio received before the delta now arriving
        self.lateness_ms = 0.0

    def arrived(self, seconds: float) -> None:
        now = self.clock()
        if self.start is None:
            self.start = now
        else:
            due = self.start + self.audio_s
            self.lateness_ms = max(self.lateness_ms, 1000.0 * (now - due))
        self.audio_s += seconds
