"""The cluster's pieces that need no Ray cluster: settings and the command line, the metrics a replica
(or `omni-rt serve`) exposes, and the ingress's merge of every replica's metrics. Quick."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import pytest

pytest.importorskip("prometheus_client")

import websockets  # noqa: E402
from server_fakes import FakeEngine, user_message  # noqa: E402

from omni_rt.cluster.settings import ClusterSettings  # noqa: E402
from omni_rt.server import Server, ServerSettings  # noqa: E402
from omni_rt.server.metrics import LATE_MS, EngineMetrics, MeteredEngine, _Playback  # noqa: E402


def test_settings_from_serve_run_arguments():
    s = ClusterSettings.from_args({"replicas": "2", "autoscale": "1,4", "max_sessions": "8", "port": "0"})
    assert s.autoscale == (1, 4) and s.max_sessions == 8 and s.port == 0
    assert s.target == 6.0  # 3/4 of max_sessions: a new replica starts before the running ones fill
    assert s.gpus == 0.0  # tiny runs on the CPU
    assert ClusterSettings(model="/models/x").gpus == 1.0
    assert ClusterSettings().audio_frames == 100  # tiny: 8 s, as omni-rt serve
    assert ClusterSettings.from_args(
        {"allowed_origins": "https://a.example,https://b.example"}
    ).allowed_origins == (
        "https://a.example",
        "https://b.example",
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"replicaz": "2"}, "unknown replicaz"),
        ({"max_sessions": "many"}, "max_sessions must be a number"),
        ({"autoscale": "4"}, "autoscale must be MIN,MAX"),
        ({"autoscale": "4,2"}, "0 <= MIN <= MAX"),
        ({"max_sessions": "0"}, "max_sessions must be at least 1"),
        ({"target_sessions": "9", "max_sessions": "8"}, "target_sessions"),
        ({"allowed_origins": "ftp://x"}, "not an http"),
        ({"ice_servers": "http://x"}, "STUN/TURN"),
    ],
)
def test_bad_settings_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        ClusterSettings.from_args(args)


def test_command_line_shares_serve_options_and_adds_the_cluster_ones():
    from omni_rt.cluster.launch import parse_args

    ours, s = parse_args(["--autoscale", "2,6", "--max-sessions", "5", "--port", "0", "--token", "t"])
    assert s.autoscale == (2, 6) and s.max_sessions == 5 and s.token == "t" and s.port == 0
    assert ours.address is None
    _, fixed = parse_args(
        ["--replicas", "3", "--model", "/m", "--num-gpus", "1", "--set", "stall_timeout_s=20"]
    )
    assert fixed.replicas == 3 and fixed.autoscale is None and fixed.gpus == 1
    assert fixed.extra == {"stall_timeout_s": 20}  # serve's --set reaches every replica's Engine.load
    with pytest.raises(SystemExit):  # one or the other
        parse_args(["--replicas", "2", "--autoscale", "1,2"])
    with pytest.raises(SystemExit):
        parse_args(["--autoscale", "x"])
    with pytest.raises(SystemExit):  # checked by omni-rt serve's own parser
        parse_args(["--max-sessions", "0"])


def test_cli_hands_serve_ray_to_the_cluster(monkeypatch):
    import omni_rt.cluster.launch as launch
    from omni_rt import cli

    seen = []
    monkeypatch.setattr(launch, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["serve", "--replicas", "2", "--ray"]) == 0
    assert seen == [["--replicas", "2"]]


def test_playback_lateness_is_the_load_protocols():
    clock = iter([0.0, 0.05, 0.2, 0.26])
    p = _Playback(clock=lambda: next(clock))
    p.arrived(0.08)  # t=0: playback starts
    p.arrived(0.08)  # t=0.05: due at 0.08, early
    p.arrived(0.08)  # t=0.2: due at 0.16, 40 ms late
    p.arrived(0.08)  # t=0.26: due at 0.24, 20 ms late
    assert p.lateness_ms == pytest.approx(40.0)
    assert p.lateness_ms > LATE_MS
    assert p.audio_s == pytest.approx(0.32)


async def test_single_process_server_serves_metrics_of_its_sessions():
    engine = MeteredEngine(FakeEngine(step_s=0.001), EngineMetrics())
    async with Server(engine, ServerSettings(port=0)) as server:

        def metrics() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
                assert r.headers["Content-Type"].startswith("text/plain")
                return r.read().decode()

        async with websockets.connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            assert "omni_rt_sessions 1.0" in await asyncio.to_thread(metrics)
            await ws.send(json.dumps(user_message("hi there")))
            await ws.send(json.dumps({"type": "response.create"}))
            while json.loads(await ws.recv())["type"] != "response.done":
                pass
        text = await asyncio.to_thread(metrics)
    assert 'omni_rt_responses_total{status="completed"} 1.0' in text
    assert re.search(r"^omni_rt_ttfa_ms_count 1\.0$", text, re.M)
    assert re.search(r"^omni_rt_voice_to_voice_ms_count 0\.0$", text, re.M)  # a text turn


def test_ingress_metrics_label_each_replica_and_sum_them():
    from omni_rt.cluster.wire import merged_metrics

    a, b = EngineMetrics(), EngineMetrics()
    a.sessions.set(3)
    b.sessions.set(2)
    a.ttfa.observe(15)
    b.ttfa.observe(250)
    b.late.inc()
    text = merged_metrics({"r1": a.exposition()[0].decode(), "r2": b.exposition()[0].decode()}).decode()
    assert 'omni_rt_sessions{replica="r1"} 3.0' in text and 'omni_rt_sessions{replica="r2"} 2.0' in text
    assert re.search(r"^omni_rt_cluster_sessions 5\.0$", text, re.M)
    assert re.search(r"^omni_rt_cluster_ttfa_ms_count 2\.0$", text, re.M)
    assert re.search(r'^omni_rt_cluster_ttfa_ms_bucket\{le="20\.0"\} 1\.0$', text, re.M)
    assert re.search(r"^omni_rt_cluster_late_replies_total 1\.0$", text, re.M)
    assert "omni_rt_cluster_ttfa_ms_created" not in text  # creation times are not summed
