"""Shared by the pipecat test files: a pipeline run whose steps wait on events, not sleeps or timeouts.

An `Await` among the frames to send holds back the frames after it until its event is set (by a processor
at the pipeline's end that has seen what the test waits for: a `Count`, or a test's own tap).
`run_pipeline` owns the pipeline's whole life: a step that never comes fails the test within `WAIT_S`,
and the pipeline is cancelled through pipecat (a CancelFrame, then each processor's cleanup) before the
test ends. pipecat's `run_test` leaves its runner running when it fails (its frame feeder gives up after
a 1 s start timeout): the event loop's teardown then cancelled every task at once, and pipecat's worker,
which answers cancellation by sending a CancelFrame and waiting for its own (already cancelled) tasks to
carry it, waited forever.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pipecat.frames.frames import EndFrame, Frame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.tests.utils import QueuedFrameProcessor
from pipecat.workers.runner import WorkerRunner

WAIT_S = 60.0  # a step that never comes fails the test instead of hanging it (a step takes < 3 s)


@dataclass(frozen=True)
class Await:
    """A step among the frames to send: send nothing more until `event` is set (`what` names it)."""

    event: asyncio.Event
    what: str


class Count(FrameProcessor):
    """`count.nth(kind, n)`: an event set once the n-th frame of type `kind` (from 1) has gone downstream."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: Counter[type] = Counter()  # downstream frames by each class they are an instance of
        self._events: dict[tuple[type, int], asyncio.Event] = {}

    def nth(self, kind: type[Frame], n: int) -> asyncio.Event:
        event = self._events.setdefault((kind, n), asyncio.Event())
        if self._seen[kind] >= n:
            event.set()
        return event

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            self._seen.update(type(frame).__mro__)
            for (kind, n), event in self._events.items():
                if self._seen[kind] >= n:
                    event.set()
        await self.push_frame(frame, direction)


async def run_pipeline(
    processor: FrameProcessor,
    steps: Sequence[Frame | Await],
    params: PipelineParams | None = None,
    wait_s: float = WAIT_S,
) -> tuple[list[Frame], list[Frame]]:
    """Send `steps` through a pipeline of `processor`, then an EndFrame; the frames that came out at its
    end (downstream) and at its head (upstream), StartFrame and EndFrame left out, as `run_test` returns.

    The pipeline is one task that this function waits for: if a step does not come within `wait_s`, or the
    pipeline does not start or end, it is cancelled and waited for before the TimeoutError goes up.
    """
    down: asyncio.Queue[Frame] = asyncio.Queue()
    up: asyncio.Queue[Frame] = asyncio.Queue()
    head = QueuedFrameProcessor(queue=up, queue_direction=FrameDirection.UPSTREAM)
    end = QueuedFrameProcessor(queue=down, queue_direction=FrameDirection.DOWNSTREAM)
    worker = PipelineWorker(
        Pipeline([head, processor, end]), params=params or PipelineParams(), cancel_on_idle_timeout=False,
        enable_rtvi=False,
    )  # fmt: skip
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _started(_worker, _frame) -> None:
        started.set()

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    run = asyncio.create_task(runner.run(), name="run_pipeline")
    try:
        await until(started, run, wait_s, "the pipeline to start")
        for step in steps:
            if isinstance(step, Await):
                await until(step.event, run, wait_s, step.what)
            else:
                await worker.queue_frame(step)
        await worker.queue_frame(EndFrame())
        if (await asyncio.wait({run}, timeout=wait_s))[0] == set():
            raise TimeoutError(f"the pipeline did not end within {wait_s:g} s of its EndFrame")
        run.result()
    finally:
        if not run.done():  # bounded by pipecat: 20 s for the CancelFrame, then each processor's cleanup
            await runner.cancel(reason="the test failed")
            await run
    frames = [down.get_nowait() for _ in range(down.qsize())]
    return [f for f in frames if not isinstance(f, EndFrame)], [up.get_nowait() for _ in range(up.qsize())]


async def until(event: asyncio.Event, run: asyncio.Task, wait_s: float, what: str) -> None:
    """Wait for `event`; a pipeline that ends first, or `wait_s` without it, fails the test."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter, run}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not event.is_set():
        if run.done():
            run.result()  # the pipeline's own error, if it had one
            raise AssertionError(f"the pipeline ended while the test waited for {what}")
        raise TimeoutError(f"no {what} within {wait_s:g} s")
