"""The demo page in a real headless Chromium (Debian's), loaded from the real server, driven by Playwright."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "demo.png"  # README's, rewritten only on request
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--autoplay-policy=no-user-gesture-required",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists() and not shutil.which("chromium"),
    reason="Debian's chromium is not installed (apt-get install chromium)",
)


@pytest.fixture(scope="module")
def demo_server(request):
    """The server on the shipped voices when they exist (the screenshot shows them), else on the tiny engine."""
    from server import ServerThread

    try:
        engine = request.getfixturevalue("shipped_engine")
    except pytest.skip.Exception:
        engine = request.getfixturevalue("tiny_engine")
    with ServerThread(engine) as server:
        yield server


@pytest.fixture
def page(demo_server):
    server = demo_server
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 900, "height": 820})
        errors = []
        page.on("pageerror", lambda error: errors.append(error))
        page.errors = errors
        page.goto(server.url + "/")
        page.wait_for_function("window.ttsDemo && window.ttsDemo.state === 'idle'", timeout=20_000)
        yield page
        browser.close()


def demo(page) -> dict:
    return page.evaluate("window.ttsDemo")


def test_speak_streams_and_schedules_audio_then_stop_ends_it(page):
    options = page.eval_on_selector_all("#voice option", "os => os.map(o => o.value)")
    assert len(options) >= 4 and "slt" in options  # filled from /v1/voices
    page.select_option("#voice", "slt")
    page.fill("#text", "The quick brown fox jumps over the lazy dog. " * 6)
    page.click("#speak")

    page.wait_for_function("window.ttsDemo.chunksScheduled >= 3", timeout=60_000)
    state = demo(page)
    assert state["chunksReceived"] >= 3 and state["chunksScheduled"] >= 3
    assert state["lastTtfaMs"] > 0
    assert page.text_content("#ttfa").strip().endswith("ms")

    page.click("#stop")
    page.wait_for_function("window.ttsDemo.lastDone !== null", timeout=20_000)
    done = demo(page)["lastDone"]
    assert done["cancelled"] is True
    received = demo(page)["chunksReceived"]
    page.wait_for_timeout(500)
    after = demo(page)
    assert after["chunksReceived"] == received  # nothing more arrives after stop
    assert after["bufferedSamples"] == 0 and after["level"] == 0  # the worklet's queue is empty: silence
    assert page.is_disabled("#stop")
    assert page.errors == []


def test_simulated_llm_stream_speaks_while_tokens_arrive(page):
    page.fill("#text", "Tokens arrive one at a time. The voice starts before the text is complete.")
    page.click("#llm")
    page.wait_for_function("window.ttsDemo.lastDone && !window.ttsDemo.lastDone.cancelled", timeout=60_000)
    state = demo(page)
    assert state["chunksScheduled"] >= 1 and state["utterances"] == 1
    assert page.text_content("#llm-out").startswith("Tokens arrive")
    assert page.errors == []


def test_speak_plays_a_whole_utterance_and_shows_its_figures(page, tmp_path):
    """``TTS_UPDATE_SCREENSHOT=1 python -m pytest tests/test_demo.py`` refreshes the README's screenshot."""
    page.fill("#text", "Please call me back when you have a moment this afternoon. The weather is lovely today.")
    page.click("#speak")
    page.wait_for_function("window.ttsDemo.lastDone && !window.ttsDemo.lastDone.cancelled", timeout=60_000)
    done = demo(page)["lastDone"]
    assert page.text_content("#rtf").strip() == f"{done['rtf']:.2f}"
    assert page.text_content("#audio-seconds").startswith(f"{done['audio_seconds']:.2f} s")
    page.wait_for_function("window.ttsDemo.bufferedSamples === 0", timeout=30_000)  # played to the end
    state = demo(page)
    assert state["samplesReceived"] == round(done["audio_seconds"] * 24_000)
    page.screenshot(path=str(SCREENSHOT if os.environ.get("TTS_UPDATE_SCREENSHOT") else tmp_path / "demo.png"))
    assert page.errors == []


def test_server_errors_are_shown_readably(page):
    page.evaluate("document.getElementById('voice').add(new Option('nobody', 'nobody'))")
    page.select_option("#voice", "nobody")
    page.click("#speak")
    page.wait_for_selector("#error:not([hidden])", timeout=20_000)
    assert "unknown voice" in page.text_content("#error")
    assert demo(page)["errors"][0]["code"] == "unknown_voice"


def test_type_as_you_go_speaks_while_typing(page):
    page.fill("#text", "")
    page.check("#live")
    page.type("#text", "Typing along, sentence by sentence. ", delay=20)
    page.wait_for_function("window.ttsDemo.chunksScheduled >= 1", timeout=60_000)
    assert demo(page)["lastDone"] is None  # speaking already, and the utterance is still open
    assert page.text_content("#speak") == "End"
    page.click("#speak")
    page.wait_for_function("window.ttsDemo.lastDone !== null", timeout=60_000)
    assert demo(page)["lastDone"]["cancelled"] is False and demo(page)["utterances"] == 1
    assert page.errors == []


def test_speak_again_while_speaking_replaces_the_utterance(page):
    page.fill("#text", "The quick brown fox jumps over the lazy dog. " * 6)
    page.click("#speak")
    page.wait_for_function("window.ttsDemo.chunksScheduled >= 2", timeout=60_000)
    page.fill("#text", "A new sentence replaces the old one.")
    page.click("#speak")
    page.wait_for_function(
        "window.ttsDemo.utterances === 2 && window.ttsDemo.lastDone && !window.ttsDemo.lastDone.cancelled",
        timeout=60_000,
    )
    assert demo(page)["errors"] == [] and page.errors == []


def test_with_an_api_key_and_a_busy_server_the_page_waits_in_the_queue(make_server):
    """A server that wants a key, its only slot taken: the page (opened as /#key=KEY) shows its place in the
    queue, and speaks once the slot frees."""
    import asyncio
    import json
    import threading

    import websockets

    from testkit import tiny_random

    server = make_server(tiny_random(max_streams=1), api_keys=("sekrit",))
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")

    async def hold_the_slot(seconds):
        async with websockets.connect(server.ws_url + "?api_key=sekrit") as ws:
            await ws.send(json.dumps({"type": "start"}))
            await ws.recv()
            await asyncio.sleep(seconds)

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page()
        page.goto(server.url + "/#key=sekrit")
        page.wait_for_function("window.ttsDemo && window.ttsDemo.state === 'idle'", timeout=20_000)
        holder = threading.Thread(target=asyncio.run, args=(hold_the_slot(3.0),))
        holder.start()
        page.wait_for_timeout(500)
        page.fill("#text", "Waiting for my turn.")
        page.click("#speak")
        page.wait_for_function("document.getElementById('status').textContent.includes('queue')", timeout=10_000)
        holder.join()
        page.wait_for_function("window.ttsDemo.lastDone && !window.ttsDemo.lastDone.cancelled", timeout=60_000)
        assert demo(page)["errors"] == [] and demo(page)["chunksReceived"] > 0
        browser.close()


class CuttableLink:
    """A TCP forwarder in front of the server, in a thread of its own: `cut()` drops every connection through it
    at once (both ends reset, no closing handshake), as a lost network would; new connections still go through."""

    def __init__(self, port: int):
        import asyncio
        import threading

        self.target, self.loop, self.writers = port, asyncio.new_event_loop(), set()
        listening = asyncio.run_coroutine_threadsafe(self._listen(), self.loop)
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = listening.result(10)

    async def _listen(self) -> int:
        import asyncio

        self.server = await asyncio.start_server(self._forward, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _forward(self, reader, writer) -> None:
        import asyncio

        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers |= {writer, up_writer}

        async def pipe(source, sink):
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except OSError:
                pass
            finally:
                sink.close()
                self.writers.discard(sink)

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        def abort_all():
            for writer in list(self.writers):
                writer.transport.abort()

        self.loop.call_soon_threadsafe(abort_all)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.cut()
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_a_dropped_connection_is_resumed_and_the_audio_goes_on_whole(make_server, tiny_engine):
    """The network between page and server is cut mid-utterance: the page reconnects, resumes the session and
    receives the rest: every sample of the utterance once (the count equals the server's), and no error shown."""
    server = make_server(tiny_engine)
    link = CuttableLink(server.port)
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    try:
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda error: errors.append(error))
            page.goto(f"http://127.0.0.1:{link.port}/")
            page.wait_for_function("window.ttsDemo && window.ttsDemo.state === 'idle'", timeout=20_000)
            page.fill("#text", "The quick brown fox jumps over the lazy dog. " * 20)
            page.click("#speak")
            page.wait_for_function("window.ttsDemo.chunksReceived >= 3", timeout=60_000)
            link.cut()
            page.wait_for_function("window.ttsDemo.lastDone !== null", timeout=60_000)
            state = demo(page)
            browser.close()
    finally:
        link.close()
    assert state["reconnects"] == 1 and state["errors"] == [] and errors == []
    assert not state["lastDone"]["cancelled"]
    assert state["samplesReceived"] == round(state["lastDone"]["audio_seconds"] * 24_000)
