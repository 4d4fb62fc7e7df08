"""The demo page in real headless Chromium (Debian's, driven by Playwright; no browser download)."""

import asyncio
import contextlib
import os
import shutil
import time
import wave
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("aiortc")
playwright_api = pytest.importorskip("playwright.async_api")

from server_fakes import FakeEngine, speech_like  # noqa: E402

from omni_rt.server import Server, ServerSettings  # noqa: E402

CHROMIUM = os.environ.get("OMNI_RT_CHROMIUM", "/usr/bin/chromium")
OUT = Path(__file__).resolve().parent.parent / "out"

# What realtime-audio.md found necessary for WebRTC audio in headless Chromium on localhost.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
    "--allow-loopback-in-peer-connection",
    "--disable-features=WebRtcHideLocalIpsWithMdns",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]

pytestmark = pytest.mark.skipif(not shutil.which(CHROMIUM), reason=f"no Chromium at {CHROMIUM}")


@contextlib.asynccontextmanager
async def open_page(server: Server, args: list[str] = CHROMIUM_ARGS):
    """Chromium on the server's page, connected; yields the page and the errors it throws."""
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            page = await browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(server.url, timeout=15_000)
            await page.click("#connect")
            await page.wait_for_selector('body[data-state="connected"]', timeout=20_000)
            yield page, errors
        finally:
            await browser.close()


async def test_page_connects_speaks_and_measures_latency():
    engine = FakeEngine(step_s=0.05, frames_per_word=3, reply="Hello from omni rt, streamed as it is made.")
    settings = ServerSettings(port=0, token="s3cret")
    async with Server(engine, settings) as server, playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 800})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(server.url, timeout=15_000)  # the URL carries ?token=
            await page.click("#connect")
            await page.wait_for_selector('body[data-state="connected"]', timeout=20_000)

            await page.fill("#text", "Say hello")
            await page.press("#text", "Enter")
            # The page's analyser hears the reply through the <audio> element's stream.
            await page.wait_for_selector('body[data-audible="true"]', timeout=20_000)
            await page.wait_for_function("window.omni.events.includes('response.done')", timeout=20_000)
            await page.wait_for_function(
                "window.omni.events.includes('output_audio_buffer.stopped')", timeout=20_000
            )

            latency = float(await page.text_content("#m-audible"))
            assert 0 < latency < 5_000
            assert float(await page.text_content("#m-ttfa")) > 0
            assert await page.text_content(".msg.user .text") == "Say hello"
            assert (
                await page.text_content(".msg.assistant .text")
                == "Hello from omni rt, streamed as it is made."
            )
            assert engine.requests == ["Say hello"]

            # The microphone toggle sends Chromium's fake device up the same transceiver; the server reads it.
            (peer,) = server.peers
            await page.click("label.switch")
            async with asyncio.timeout(10):
                while peer.input_audio_frames < 10:
                    await asyncio.sleep(0.05)
            # A new voice is the next replies' (the conversation goes on); the page marks where it changed.
            await page.select_option("#voice", "chelsie")
            await page.wait_for_selector(".divider", timeout=10_000)
            assert await page.text_content(".divider") == "Voice: Chelsie"
            assert len(engine.sessions) == 1 and engine.open_sessions == 1 and peer.voice == "chelsie"
            assert errors == []

            OUT.mkdir(exist_ok=True)
            shot = OUT / "browser-demo.png"
            await page.screenshot(path=str(shot))
            assert shot.stat().st_size > 10_000
        finally:
            await browser.close()
        assert len(server.peers) <= 1  # the closed tab's peer is going or gone


def write_wav(path: Path, audio: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())


async def test_page_answers_speech_and_cuts_playback_on_barge_in(tmp_path):
    """The microphone is Chromium's fake device playing a file: a turn, a pause while the reply plays,
    a second turn that interrupts it. The page shows the states, hears the reply, and cuts it."""
    rate = 48000

    def silence(s: float) -> np.ndarray:
        return np.zeros(int(s * rate), np.float32)

    wav = tmp_path / "speech.wav"
    # turn one ends at ~1.8 s (500 ms of silence after it); the reply then plays; turn two at 3.8 s
    write_wav(
        wav,
        np.concatenate(
            [silence(0.3), speech_like(1.0, rate), silence(2.5), speech_like(1.0, rate, seed=1), silence(3.0)]
        ),
        rate,
    )
    # still generating when turn two comes (5 s), so the barge-in cancels it rather than cutting playout
    engine = FakeEngine(step_s=0.05, frames_per_word=3, reply=" ".join(["la"] * 100))
    args = [*CHROMIUM_ARGS, f"--use-file-for-fake-audio-capture={wav}%noloop"]
    async with Server(engine, ServerSettings(port=0)) as server, open_page(server, args) as (page, errors):
        assert await page.text_content("#listen") == "mic off"
        await page.click("label.switch")  # the file starts playing when capture starts
        await page.wait_for_selector('body[data-listen="speech"]', timeout=10_000)
        assert await page.text_content("#listen") == "speech detected"
        await page.wait_for_selector('body[data-listen="speaking"]', timeout=10_000)
        await page.wait_for_selector('body[data-audible="true"]', timeout=10_000)  # the reply is heard
        # "thinking" lasts as long as the first audio takes (a few ms here): read the history
        listens = await page.evaluate("window.omni.listens")
        assert listens[:4] == ["listening", "speech", "thinking", "speaking"]
        # Turn two interrupts: the server cuts and cancels the reply, the page mutes what it holds.
        await page.wait_for_function("window.omni.cuts >= 1", timeout=10_000)
        await page.wait_for_selector('.msg.assistant[data-status="cancelled"]', timeout=10_000)
        # the first-audible figure of a spoken reply counts from the end of speech, not speech_stopped:
        # the page moved it back by the silence window (500 ms, in 32 ms frames)
        eos = await page.evaluate("window.omni.endOfSpeech")
        assert eos is not None and eos["waitMs"] == 16 * 32
        events = await page.evaluate("window.omni.events")
        first_cut = events.index("output_audio_buffer.cleared")
        assert (
            "input_audio_buffer.speech_started"
            in events[events.index("output_audio_buffer.started") : first_cut]
        )
        assert await page.locator(".msg.user.spoken").count() >= 1
        assert len(engine.audio_requests) >= 1 and engine.audio_requests[0][1] == 16000
        turn_s = len(engine.audio_requests[0][0]) / 16000
        assert 1.2 < turn_s < 2.5  # prefix + the 1 s turn + the silence window
        assert errors == []
        OUT.mkdir(exist_ok=True)
        await page.screenshot(path=str(OUT / "browser-speech.png"))


@pytest.fixture(scope="module")
def tiny():
    import omni_rt

    return omni_rt.Engine.load("tiny")


async def test_page_plays_the_tiny_engine(tiny):
    """The README's path: the real pipeline on the tiny preset, heard by the page."""
    from omni_rt.server import PeerSettings

    settings = ServerSettings(port=0, peer=PeerSettings(max_output_tokens=16, max_audio_frames=25))
    async with tiny, Server(tiny, settings) as server, playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 800})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(server.url, timeout=15_000)
            await page.click("#connect")
            await page.wait_for_selector('body[data-state="connected"]', timeout=20_000)
            # OpenAI's flow: an ephemeral key, then a call placed with it over /v1/realtime/calls.
            ((key, secret),) = server.rest.keys.items()
            assert key.startswith("ek_") and secret.expires_at > time.time()
            assert len(server.rest.calls) == 1 and not any(p.ws for p in server.peers)
            await page.fill("#text", "Hello!")
            await page.press("#text", "Enter")
            await page.wait_for_selector('body[data-audible="true"]', timeout=30_000)
            await page.wait_for_function("window.omni.events.includes('response.done')", timeout=60_000)
            latency = float(await page.text_content("#m-audible"))
            assert 0 < latency < 10_000
            assert float(await page.text_content("#m-ttfa")) > 0
            assert float(await page.text_content("#m-ttft")) > 0
            assert await page.locator(".msg.assistant").count() == 1
            assert errors == []
            OUT.mkdir(exist_ok=True)
            await page.screenshot(path=str(OUT / "browser-demo-tiny.png"))
        finally:
            await browser.close()


async def test_page_without_token_is_refused():
    engine = FakeEngine()
    async with (
        Server(engine, ServerSettings(port=0, token="s3cret")) as server,
        playwright_api.async_playwright() as pw,
    ):
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(f"http://127.0.0.1:{server.port}/", timeout=15_000)  # no ?token=
            await page.click("#connect")
            await page.wait_for_selector(
                '#status[data-kind="idle"], #status[data-kind="error"]', timeout=10_000
            )
            await page.wait_for_function("!document.getElementById('toast').hidden", timeout=10_000)
            assert "token" in (await page.text_content("#toast"))
            assert engine.open_sessions == 0
        finally:
            await browser.close()


async def test_page_recovers_from_refusals_reconnects_cleanly_and_works_by_keyboard():
    from omni_rt.server import PeerSettings

    engine = FakeEngine(step_s=0.05, frames_per_word=3, reply="one two three four five six")
    # The server refuses long messages (pending_input_full), so the page sees a refused request.
    settings = ServerSettings(port=0, peer=PeerSettings(max_pending_text_chars=20))
    async with Server(engine, settings) as server, open_page(server) as (page, errors):
        # Named controls; the connection state is announced.
        assert await page.get_by_role("textbox", name="Message").count() == 1
        assert await page.get_by_role("status").text_content() == "Connected"

        # A network drop shows (WebRTC "disconnected": ICE consent lost), and so does the way back.
        flip = """state => { const pc = window.omni.state.pc;
            Object.defineProperty(pc, "connectionState", {get: () => state, configurable: true});
            pc.dispatchEvent(new Event("connectionstatechange")); }"""
        await page.evaluate(flip, "disconnected")
        assert await page.get_by_role("status").text_content() == "Connection interrupted…"
        await page.evaluate(flip, "connected")
        assert await page.get_by_role("status").text_content() == "Connected"

        # A refused request (an error for it, no response) leaves nothing pending: the next
        # message is sent at once, with no stray response.cancel and no 2 s wait.
        await page.fill("#text", "x" * 40)
        await page.press("#text", "Enter")
        await page.wait_for_function("!document.getElementById('toast').hidden", timeout=10_000)
        await page.wait_for_function("window.omni.state.pending === null", timeout=5_000)
        await page.fill("#text", "hi")
        await page.press("#text", "Enter")
        await page.wait_for_selector('body[data-audible="true"]', timeout=20_000)
        await page.wait_for_function("window.omni.events.includes('response.done')", timeout=20_000)
        assert engine.requests == ["hi"]

        # Keyboard: the microphone switch shows where the focus is.
        await page.focus("#mic")
        await page.keyboard.press("Shift+Tab")
        await page.keyboard.press("Tab")
        outline = await page.eval_on_selector(".switch .slider", "e => getComputedStyle(e).outlineStyle")
        assert outline != "none"

        # Disconnect mid-reply: the old connection's audio graph and streaming bubble are let go.
        await page.fill("#text", "again")
        await page.press("#text", "Enter")
        await page.wait_for_function("window.omni.state.response !== null", timeout=10_000)
        await page.click("#connect")  # now "Disconnect"
        await page.wait_for_selector('body[data-state="idle"]', timeout=10_000)
        assert await page.evaluate("window.omni.state.analyser === null")
        assert await page.locator(".msg.streaming").count() == 0
        # And a new connection works as the first did.
        await page.click("#connect")
        await page.wait_for_selector('body[data-state="connected"]', timeout=20_000)
        await page.evaluate("delete document.body.dataset.audible")
        await page.fill("#text", "third")
        await page.press("#text", "Enter")
        await page.wait_for_selector('body[data-audible="true"]', timeout=20_000)
        assert errors == []


async def test_page_mic_toggle_races_and_a_voice_change_mid_reply():
    engine = FakeEngine(step_s=0.05, frames_per_word=3, reply=" ".join(["la"] * 200))
    async with Server(engine, ServerSettings(port=0)) as server, open_page(server) as (page, errors):
        # On and off before the microphone opened: it must end off, not live behind an unchecked box.
        await page.evaluate("() => { const mic = document.getElementById('mic'); mic.click(); mic.click(); }")
        await asyncio.sleep(1.0)
        assert await page.evaluate("document.getElementById('mic').checked") is False
        assert await page.evaluate("window.omni.state.micStream === null")
        assert await page.evaluate("window.omni.state.transceiver.sender.track === null")
        # On, then disconnected before the microphone opened: nothing is left capturing.
        await page.evaluate(
            "() => { document.getElementById('mic').click(); document.getElementById('connect').click(); }"
        )
        await page.wait_for_selector('body[data-state="idle"]', timeout=10_000)
        await asyncio.sleep(1.0)
        assert await page.evaluate("window.omni.state.micStream === null")
        await page.click("#connect")
        await page.wait_for_selector('body[data-state="connected"]', timeout=20_000)

        # A new voice while a reply is in progress is the next reply's (as on OpenAI's server): the reply
        # goes on in its voice, the page marks the change, the choice stays.
        await page.fill("#text", "talk")
        await page.press("#text", "Enter")
        await page.wait_for_function("window.omni.state.response !== null", timeout=10_000)
        await page.select_option("#voice", "chelsie")
        await page.wait_for_selector(".divider", timeout=10_000)
        assert await page.text_content(".divider") == "Voice: Chelsie"
        assert await page.evaluate("document.getElementById('voice').value") == "chelsie"
        assert await page.evaluate("document.getElementById('toast').hidden")
        assert next(iter(server.peers)).voice == "chelsie" and engine.voices[-1] == "ethan"

        # The connection drops while the user types: the keyboard focus is not lost with the
        # disabled message box; it moves to the Connect button.
        await page.focus("#text")
        (peer,) = server.peers
        await peer.close()  # the server ends the call: the page sees its connection drop
        await page.wait_for_selector('body[data-state="error"]', timeout=10_000)
        assert await page.evaluate("document.activeElement.id") == "connect"
        assert errors == []


async def test_reply_after_reply_stays_prompt():
    # Replies a second or so apart, as in a conversation. With a track that sends nothing between
    # replies and contiguous timestamps, Chromium's jitter buffer takes each gap for network delay and
    # grows its target: the third reply was heard ~0.8 s after it left (the first two in ~25 ms).
    engine = FakeEngine(step_s=0.01, frames_per_word=3, reply="a b c d e f g h")
    async with Server(engine, ServerSettings(port=0)) as server, open_page(server) as (page, errors):
        for i in range(4):
            await page.evaluate("delete document.body.dataset.audible")
            stopped = await page.evaluate("window.omni.events.filter(e => e.endsWith('.stopped')).length")
            await page.fill("#text", f"reply {i}")
            await page.press("#text", "Enter")
            await page.wait_for_function(
                f"window.omni.events.filter(e => e.endsWith('.stopped')).length > {stopped}",
                timeout=20_000,
            )
            await asyncio.sleep(1.2)  # the user thinks, then asks again
        latencies = await page.evaluate("window.omni.latencies")
        assert len(latencies) == 4 and max(latencies) < 400, latencies
        assert errors == []


CONTROLS = ["#connect", "#text", "#speak", "#stop", "#voice", "label.switch .slider", "#listen", "#speaking"]

# For each control: inside the viewport and the topmost element at its centre (nothing covers it).
LAYOUT_PROBE = """sel => {
    const e = document.querySelector(sel), r = e.getBoundingClientRect();
    e.scrollIntoView({block: "center", inline: "nearest"});
    const q = e.getBoundingClientRect();
    const top = document.elementFromPoint(q.left + q.width / 2, q.top + q.height / 2);
    return {left: r.left, right: r.right, width: r.width, height: r.height,
            covered: !(top && (top === e || e.contains(top) || top.contains(e)))};
}"""


@pytest.mark.parametrize("width", [360, 390])
async def test_the_page_fits_a_phone_and_nothing_covers_its_controls(width):
    engine = FakeEngine(step_s=0.05, frames_per_word=3, reply="a short reply")
    async with Server(engine, ServerSettings(port=0)) as server, playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": width, "height": 780})
            await page.goto(server.url, timeout=15_000)
            await page.click("#connect")
            await page.wait_for_selector('body[data-state="connected"]', timeout=20_000)
            assert await page.text_content("#speak") == "Send"  # a conversation, not text-to-speech
            assert "say" not in (await page.get_attribute("#text", "placeholder")).split()[-1]
            await page.evaluate("toast('A long error message that must not cover any of the buttons at all')")
            for _ in range(2):  # with the toast up, then with a message typed at the limit
                overflow = await page.evaluate("document.documentElement.scrollWidth")
                assert overflow <= width, f"the page is {overflow} px wide at {width} px"
                for sel in CONTROLS:
                    box = await page.evaluate(LAYOUT_PROBE, sel)
                    assert box["width"] > 0 and box["height"] > 0, sel
                    assert box["left"] >= 0 and box["right"] <= width, (sel, box)
                    assert not box["covered"], sel
                await page.fill("#text", "x" * 5000)  # the box keeps 4,000 and says so
            assert len(await page.input_value("#text")) == 4000
            assert await page.is_visible("#text-limit")
            await page.press("#text", "Enter")
            await page.wait_for_selector("#text-limit", state="hidden", timeout=5_000)
            OUT.mkdir(exist_ok=True)
            await page.screenshot(path=str(OUT / f"browser-{width}px.png"), timeout=60_000)
        finally:
            await browser.close()


async def test_one_speaking_badge_with_the_microphone_on():
    engine = FakeEngine(step_s=0.05, frames_per_word=3, reply=" ".join(["la"] * 60))
    async with Server(engine, ServerSettings(port=0)) as server, open_page(server) as (page, errors):
        await page.click("label.switch")
        await page.wait_for_selector('#listen[data-kind="listening"]', timeout=10_000)
        await page.fill("#text", "talk")
        await page.press("#text", "Enter")
        await page.wait_for_selector('#listen[data-kind="speaking"]', timeout=20_000)
        shown = await page.evaluate(
            "[...document.querySelectorAll('.badge')].filter(b => b.offsetParent).map(b => b.textContent)"
        )
        assert shown.count("speaking") == 1, shown
        assert errors == []


# Samples the page's analyser (what the <audio> element plays) every 5 ms: [ms, peak] pairs.
LEVEL_PROBE = """() => {
    window.levels = [];
    const buf = new Float32Array(512);
    window.levelTimer = setInterval(() => {
        const a = window.omni.state.analyser;
        if (!a) return;
        a.getFloatTimeDomainData(buf);
        let peak = 0;
        for (const v of buf) peak = Math.max(peak, Math.abs(v));
        window.levels.push([performance.now(), peak]);
    }, 5);
}"""


# True once the probe has heard sound and then 300 ms without any.
PLAYED_OUT = """() => {
    const l = window.levels, end = l.length ? l[l.length - 1][0] : 0;
    const loud = l.filter(([, peak]) => peak > 0.01);
    return loud.length > 0 && end - loud[loud.length - 1][0] >= 300;
}"""


def audibility(levels: list[list[float]], threshold: float = 0.01) -> tuple[float, float, float]:
    """(seconds from the first sound to the last, share of that heard, longest silence in ms)."""
    loud = [t for t, peak in levels if peak > threshold]
    if not loud:
        return 0.0, 0.0, float("inf")
    span = [(t, peak) for t, peak in levels if loud[0] <= t <= loud[-1]]
    heard = gap = longest = 0.0
    for (t0, p0), (t1, _) in zip(span, span[1:], strict=False):
        if p0 > threshold:
            heard += t1 - t0
            gap = 0.0
        else:
            gap += t1 - t0
            longest = max(longest, gap)
    total = loud[-1] - loud[0]
    return total / 1000, heard / total if total else 0.0, longest


async def test_a_tiny_reply_plays_without_gaps(tiny):
    """The embedded default as `omni-rt serve` runs it (tiny, 8 s replies, 1024 text tokens), heard in
    Chromium on this 2-core machine: the track must never run dry (its random-weight audio is loud
    throughout, so any silence inside the reply is an underrun). Issue 13, defect 6; what it took is in
    docs/performance.md (2026-12-01, evening and night). Random weights sometimes end a reply after a
    few words (about one seed in eight: an early `<|im_end|>`); such a reply is checked too, and another
    turn is asked for until one has the full length (at most three)."""
    from omni_rt.server import PeerSettings
    from omni_rt.server.app import TINY_REPLY_SECONDS

    peer = PeerSettings(max_audio_frames=round(TINY_REPLY_SECONDS / 0.08))
    heard = []  # (seconds, share audible, longest gap ms) of each reply
    async with (
        tiny,
        Server(tiny, ServerSettings(port=0, peer=peer)) as server,
        open_page(server) as (page, errors),
    ):
        # as served: the track holds the lead that the CPU's Code2Wav chunk plan counts on
        assert server.settings.peer.start_lead_ms == tiny.settings.playout_lead_ms == 100
        for turn in range(3):
            await page.evaluate(LEVEL_PROBE)
            await page.fill("#text", "Hello! Tell me about the sea." if turn == 0 else "Tell me more.")
            await page.press("#text", "Enter")
            await page.wait_for_function(
                f"window.omni.events.filter(e => e === 'output_audio_buffer.stopped').length > {turn}",
                timeout=120_000,
            )
            # the last frames through the jitter buffer: the probe hears 300 ms of silence after them
            await page.wait_for_function(PLAYED_OUT, timeout=10_000)
            levels = await page.evaluate("clearInterval(window.levelTimer), window.levels")
            heard.append(audibility(levels))
            seconds, share, longest_gap = heard[-1]
            assert share >= 0.95 and longest_gap <= 100, heard
            if seconds > 0.9 * TINY_REPLY_SECONDS:  # the whole reply was heard
                break
        assert heard[-1][0] > 0.9 * TINY_REPLY_SECONDS, heard
        assert errors == []
