"""Soak: N conversations on `tiny` for M minutes through `omni-rt serve`'s server, on loopback only.

    python scripts/soak.py --minutes 10 --conversations 3 [--json soak.json] [--check]

The server and engine run in this process (so their memory, threads and tasks can be counted); the
clients are WebSocket clients of the realtime protocol on 127.0.0.1. Each conversation loops, at random
(seeded): a text turn, a spoken turn (`input_audio_buffer.append` + commit), a barge-in (cancel after
the first audio) and a disconnect mid-reply (the socket closed without a goodbye, then a new one).

Reported every few seconds: RSS, open fds, threads, asyncio tasks, server sessions and free engine
slots; at the end every response's end status and any stuck response (no response.done within
--stuck-s). With --check it exits 1 unless: nothing stuck, every session and slot given back and the
tasks back to where they were, and RSS growth after the warm-up under --max-rss-growth-mb.
Bounded: it stops at --minutes, each wait has a limit, and nothing listens beyond loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import websockets  # noqa: E402

import omni_rt  # noqa: E402
from omni_rt.server import PeerSettings, Server, ServerSettings  # noqa: E402

RATE_IN = 24000  # input_audio_buffer.append: 24 kHz mono PCM16


@dataclass
class Sample:
    t_s: float
    rss_mb: float
    fds: int
    threads: int
    tasks: int
    sessions: int
    free_slots: int


@dataclass
class Report:
    minutes: float
    conversations: int
    samples: list[Sample] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)  # "<action>:<status>" -> count
    stuck: list[str] = field(default_factory=list)  # what waited past --stuck-s, and where
    errors: list[str] = field(default_factory=list)  # error events the server sent (codes)
    # each error event's "code: message" during a turn, and each failed response's error: what failed it
    error_messages: Counter = field(default_factory=Counter)
    warm_rss_mb: float = 0.0
    end_rss_mb: float = 0.0
    left_sessions: int = 0
    left_slots: int = 0
    left_tasks: int = 0

    @property
    def rss_growth_mb(self) -> float:
        return self.end_rss_mb - self.warm_rss_mb

    def failures(self, max_rss_growth_mb: float) -> list[str]:
        out = []
        if self.stuck:
            out.append(f"{len(self.stuck)} stuck: {self.stuck[:5]}")
        if self.left_sessions or self.left_slots or self.left_tasks:
            out.append(
                f"left behind: {self.left_sessions} sessions, {self.left_slots} slots, {self.left_tasks} tasks"
            )
        if self.rss_growth_mb >= max_rss_growth_mb:
            out.append(f"RSS grew {self.rss_growth_mb:.1f} MB after the warm-up (limit {max_rss_growth_mb})")
        if not sum(self.statuses.values()):
            out.append("no response finished")
        return out


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def pcm16_b64(audio: np.ndarray) -> str:
    return base64.b64encode((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()).decode()


def speech_like(rng: np.random.Generator, seconds: float) -> np.ndarray:
    """A voiced burst (a few harmonics with a wobble): what the spoken turns say."""
    t = np.arange(int(RATE_IN * seconds)) / RATE_IN
    f0 = 120 + 30 * np.sin(2 * np.pi * 3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / RATE_IN
    voice = sum(np.sin(k * phase) / k for k in range(1, 5))
    return (0.2 * voice + 0.01 * rng.standard_normal(len(t))).astype(np.float32)


class Conversation:
    """One client: its own socket, reconnecting after each disconnect."""

    def __init__(self, n: int, url: str, report: Report, deadline: float, stuck_s: float, seed: int) -> None:
        self.n, self.url, self.report, self.deadline, self.stuck_s = n, url, report, deadline, stuck_s
        self.rng = random.Random(seed)
        self.audio_rng = np.random.default_rng(seed)
        self.recent: deque[str] = deque(maxlen=12)  # the last events and actions, for a stuck report

    async def run(self) -> None:
        while time.monotonic() < self.deadline:
            ws = await self._connect()
            if ws is None:
                return
            async with ws:
                update = {"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}}
                await ws.send(json.dumps(update))
                if await self._expect(ws, "session.updated", "session.update") is None:
                    return
                while time.monotonic() < self.deadline:
                    action = self.rng.choices(["text", "speech", "barge-in", "disconnect"], [4, 3, 2, 1])[0]
                    if not await self._turn(ws, action):
                        break  # disconnected: a new socket

    async def _connect(self):
        """A new socket with its session.created; a server still letting go of this client's previous
        session may refuse with 1013 (try again later): so it does, for at most stuck_s."""
        limit = time.monotonic() + self.stuck_s
        while True:
            try:
                ws = await websockets.connect(self.url, max_size=2**24, open_timeout=self.stuck_s)
                first = json.loads(await asyncio.wait_for(ws.recv(), self.stuck_s))
                if first["type"] == "session.created":
                    return ws
                await ws.close()
                self.report.errors.append(first.get("error", {}).get("code") or first["type"])
            except websockets.exceptions.ConnectionClosed as e:
                if e.rcvd is None or e.rcvd.code != 1013:
                    self.report.stuck.append(f"conversation {self.n}: connect closed: {e}")
                    return None
            except (OSError, websockets.exceptions.WebSocketException, TimeoutError) as e:
                self.report.stuck.append(f"conversation {self.n}: connect failed: {e!r}")
                return None
            self.report.statuses["connect:busy"] += 1
            if time.monotonic() > limit:
                self.report.stuck.append(f"conversation {self.n}: refused as busy for {self.stuck_s:g} s")
                return None
            await asyncio.sleep(0.25)

    async def _turn(self, ws, action: str) -> bool:
        self.recent.append(f"<{action}>")
        if action == "speech":
            clip = speech_like(self.audio_rng, self.rng.uniform(0.4, 1.2))
            for i in range(0, len(clip), RATE_IN // 5):  # 200 ms per append, as a microphone would
                await ws.send(
                    json.dumps(
                        {"type": "input_audio_buffer.append", "audio": pcm16_b64(clip[i : i + RATE_IN // 5])}
                    )
                )
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await self._expect(ws, "input_audio_buffer.committed", "commit")
        else:
            words = " ".join(
                self.rng.choice(["hello", "tell", "me", "about", "the", "sea", "why"]) for _ in range(6)
            )
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": words}]}
            await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
        await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 24}}))
        if action == "disconnect":
            await self._expect(ws, "response.created", "response.create")
            ws.transport.abort()  # gone mid-reply, no close frame
            self.report.statuses["disconnect:dropped"] += 1
            return False
        if action == "barge-in":
            first = await self._expect(
                ws, ("response.output_audio.delta", "response.done"), "first audio", keep_going=True
            )
            if first is not None and first["type"] != "response.done":
                await ws.send(json.dumps({"type": "response.cancel"}))
            else:
                self._count(action, first)
                return first is not None
        done = await self._expect(ws, "response.done", action)
        self._count(action, done)
        return done is not None

    def _count(self, action: str, done: dict | None) -> None:
        if done is not None:
            response = done["response"]
            status = response["status"]
            if status == "incomplete":  # e.g. a reply that used all its tokens: say why
                status += f":{(response.get('status_details') or {}).get('reason', '?')}"
            if status == "failed":  # and what failed it
                error = (response.get("status_details") or {}).get("error") or {}
                self.report.error_messages[f"{action} failed: {_said(error)}"] += 1
            self.report.statuses[f"{action}:{status}"] += 1

    async def _expect(
        self, ws, types: str | tuple[str, ...], what: str, keep_going: bool = False
    ) -> dict | None:
        """The next event of `types` (others are read past), or None and a stuck record after stuck_s."""
        types = (types,) if isinstance(types, str) else types
        limit = time.monotonic() + self.stuck_s
        while True:
            try:
                raw = await asyncio.wait_for(ws.recv(), max(0.0, limit - time.monotonic()))
            except TimeoutError:
                self.report.stuck.append(
                    f"conversation {self.n}: no {'/'.join(types)} after {what} (last: {list(self.recent)})"
                )
                return None
            except websockets.exceptions.ConnectionClosed as e:
                self.report.stuck.append(f"conversation {self.n}: closed waiting for {'/'.join(types)}: {e}")
                return None
            ev = json.loads(raw)
            if not ev["type"].endswith("delta"):
                self.recent.append(ev["type"])
            if ev["type"] == "error":
                self.report.errors.append(ev["error"].get("code") or "?")
                self.report.error_messages[_said(ev["error"])] += 1
            if ev["type"] in types:
                return ev


def _said(error: dict) -> str:
    """An error object of the protocol as "code: message" (the message cut at 200 characters)."""
    return f"{error.get('code') or error.get('type') or '?'}: {str(error.get('message'))[:200]}"


async def soak(
    minutes: float,
    conversations: int = 3,
    seed: int = 0,
    stuck_s: float = 60.0,
    sample_s: float = 5.0,
    warmup_s: float | None = None,
    max_audio_s: float = 2.0,
    log=print,
) -> Report:
    report = Report(minutes=minutes, conversations=conversations)
    engine = omni_rt.Engine.load("tiny", max_sessions=conversations)
    settings = ServerSettings(
        host="127.0.0.1",  # loopback only
        port=0,
        max_sessions=conversations,
        peer=PeerSettings(
            model="tiny", max_audio_frames=max(1, round(max_audio_s / 0.08)), turn_detection=None
        ),
    )
    warmup_s = min(60.0, minutes * 60 / 4) if warmup_s is None else warmup_s
    async with engine, Server(engine, settings) as server:
        baseline_tasks = len(asyncio.all_tasks())
        t0 = time.monotonic()
        deadline = t0 + minutes * 60
        clients = [
            asyncio.create_task(
                Conversation(i, f"ws://127.0.0.1:{server.port}/ws", report, deadline, stuck_s, seed + i).run()
            )
            for i in range(conversations)
        ]
        warm_marked = False
        while not all(c.done() for c in clients):
            await asyncio.wait(clients, timeout=sample_s)
            s = Sample(
                t_s=round(time.monotonic() - t0, 1), rss_mb=round(rss_mb(), 1), fds=fd_count(),
                threads=threading.active_count(), tasks=len(asyncio.all_tasks()), sessions=len(server.peers),
                free_slots=conversations - engine.capacity.sessions,
            )  # fmt: skip
            report.samples.append(s)
            if not warm_marked and s.t_s >= warmup_s:
                report.warm_rss_mb, warm_marked = s.rss_mb, True
            log(
                f"{s.t_s:7.1f} s  rss {s.rss_mb:7.1f} MB  fds {s.fds:4d}  threads {s.threads:3d}  tasks {s.tasks:4d}  "
                f"sessions {s.sessions}  free slots {s.free_slots}  responses {sum(report.statuses.values())}"
            )
        for c in clients:
            c.result()  # a client's own bug surfaces here
        # every socket is closed: the server must give every session, slot and task back, soon
        settle = time.monotonic() + stuck_s
        while time.monotonic() < settle and (server.peers or engine.capacity.sessions):
            await asyncio.sleep(0.1)
        for _ in range(50):  # tasks that end with their peers finish within a few loop turns
            if len(asyncio.all_tasks()) <= baseline_tasks:
                break
            await asyncio.sleep(0.1)
        report.left_sessions = len(server.peers)
        report.left_slots = engine.capacity.sessions
        report.left_tasks = max(0, len(asyncio.all_tasks()) - baseline_tasks)
        report.end_rss_mb = round(rss_mb(), 1)
        if not warm_marked:
            report.warm_rss_mb = report.samples[0].rss_mb if report.samples else report.end_rss_mb
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Soak omni-rt's server on loopback with the tiny preset.")
    p.add_argument("--minutes", type=float, default=10.0, help="how long the conversations run (default 10)")
    p.add_argument("--conversations", type=int, default=3, help="concurrent conversations (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the clients' choices")
    p.add_argument("--stuck-s", type=float, default=60.0, help="a wait longer than this is a stuck response")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between resource samples")
    p.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="RSS growth counts from here (default: a quarter, at most 60 s)",
    )
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0, help="--check's limit on RSS growth")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--check", action="store_true", help="exit 1 when the soak found a problem")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.conversations < 1:
        p.error("--minutes must be positive and --conversations at least 1")
    report = asyncio.run(
        soak(args.minutes, args.conversations, args.seed, args.stuck_s, args.sample_s, args.warmup_s)
    )
    print(f"responses: {dict(sorted(report.statuses.items()))}")
    print(f"errors from the server: {dict(Counter(report.errors))}")
    if report.error_messages:
        print(f"their messages: {dict(report.error_messages)}")
    print(f"RSS {report.warm_rss_mb} MB after the warm-up -> {report.end_rss_mb} MB at the end")
    failures = report.failures(args.max_rss_growth_mb)
    print("stuck: none" if not report.stuck else f"stuck: {report.stuck}")
    if args.json:
        data = vars(report) | {
            "samples": [asdict(x) for x in report.samples],
            "statuses": dict(report.statuses),  # asdict() would rebuild the Counter from its items
            "error_messages": dict(report.error_messages),
            "rss_growth_mb": report.rss_growth_mb,
            "failures": failures,
        }
        Path(args.json).write_text(json.dumps(data, indent=1))
        print(f"wrote {args.json}")
    for f in failures:
        print(f"FAIL: {f}")
    return 1 if args.check and failures else 0


if __name__ == "__main__":
    sys.exit(main())
