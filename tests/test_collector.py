"""The cycle collector while engines run (omni_rt/collector.py): what is alive at the first start is
frozen out of full collections until the last stop."""

from __future__ import annotations

import gc
import weakref

import omni_rt
from omni_rt import collector
from omni_rt.engine import Engine
from omni_rt.model.config import preset
from omni_rt.pipeline.fake import FakeCode2Wav, FakeTalker, FakeThinker, FakeTimings
from omni_rt.tokenizer import Tokenizer

CFG = preset("tiny")


def engine(**settings) -> Engine:
    t = FakeTimings(thinker_prefill=0.001, thinker_decode=0.001, talker_prefix=0.001)
    return Engine(
        CFG,
        Tokenizer.tiny(CFG.ids),
        lambda s: (FakeThinker(t, CFG.ids), FakeTalker(t, CFG.ids), FakeCode2Wav(t)),
        omni_rt.EngineSettings(**settings),
    )


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cycle collector frees it


async def test_what_lives_at_start_is_frozen_until_the_last_engine_stops():
    assert collector.holds() == 0 and gc.get_freeze_count() == 0
    early = Node()
    early_ref = weakref.ref(early)
    a, b = engine(), engine()
    async with a:
        assert gc.get_freeze_count() > 0 and collector.holds() == 1
        async with b:
            assert collector.holds() == 2
        assert collector.holds() == 1  # a still runs
        del early
        gc.collect()
        assert early_ref() is not None  # frozen: a full collection did not look at it
        late = Node()
        late_ref = weakref.ref(late)
        del late
        gc.collect()
        assert late_ref() is None  # what came later is collected as usual
    assert collector.holds() == 0 and gc.get_freeze_count() == 0
    gc.collect()
    assert early_ref() is None  # back in sight after the last stop


async def test_an_engine_can_leave_the_collector_alone():
    async with engine(freeze_collector=False):
        assert collector.holds() == 0 and gc.get_freeze_count() == 0


async def test_a_second_stop_does_not_release_another_engines_hold():
    a, b = engine(), engine()
    async with a:
        await b.start()
        await b.stop()
        await b.stop()
        assert collector.holds() == 1 and gc.get_freeze_count() > 0
    assert collector.holds() == 0


def test_pauses_count_the_full_collections_in_their_block():
    with collector.Pauses() as pauses:
        gc.collect(0)
        gc.collect()
        gc.collect()
    gc.collect()  # after the block: not counted
    s = pauses.summary()
    assert s["full"] == 2 and s["full_ms"] >= s["full_max_ms"] > 0
    assert [gen for gen, _ in pauses.records] == [0, 2, 2]
