"""`python -m desktop.tools.screenshots OUT`: some of the pictures desktop/README.md shows, taken from the real
window driven as a person would (two messages sent, the tokens coloured by probability), in both themes: the
window at 1000×700 (reply-footer-meter-*-1000.png), the Settings dialog's sampling, the Models dialog at its
default size and its Hub tab offline; with `--only requests`, the Requests tab with three replies in flight
(requests-three-in-flight.png: a model slow enough to catch them, e.g. the SmolLM2 GGUF); with `--only
alternatives`, the same tab while three alternatives of one reply stream on the prompt's blocks, held once
(requests-alternatives-shared.png); with `--only drafts`, a code rewrite drafted by lookup in the conversation,
its tokens coloured by their part in the drafts and the panel's Speculative decoding rows (tokens-drafts.png);
with `--only tools`, a tool call asked (tool-call-question.png) and, allowed, its result opened and the reply
from it (tool-call-approved.png), from an MCP server written here — give it a model whose template takes tools.
Run it under a display (Xvfb: what a person sees) into resources/screenshots; offscreen works too (Qt's own
raster).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

MESSAGES = ("I am planning a trip to Chengdu for 3 nights. My budget is 600 yuan.", "What should I eat?")
WINDOW = (1000, 700)


REWRITE = (
    "Rewrite this function with `prices` renamed to `amounts`, nothing else changed:\n\n"
    "def total(prices, tax):\n    result = 0\n    for p in prices:\n        result = result + p * (1 + tax)\n"
    "    return result"
)
TRIP = {"title": "trip", "type": "object", "additionalProperties": False, "required": ["city", "nights"],
        "properties": {"city": {"type": "string", "maxLength": 24},
                       "nights": {"type": "integer", "minimum": 1, "maximum": 14}}}  # fmt: skip
WEATHER_SERVER = """from mcp.server.mcpserver import MCPServer
app = MCPServer("weather")
@app.tool()
def get_weather(city: str) -> str:
    \"\"\"The weather in a city now: temperature, sky and wind.\"\"\"
    return f'{"{"}"city": "{city}", "temperature_c": 21, "sky": "clear", "wind_kmh": 8{"}"}'
app.run("stdio")
"""
REQUESTS = (
    "Plan three nights in Chengdu on 600 yuan.",
    "Explain a KV cache to a child.",
    "Tell me a long story about a lighthouse keeper.",
)


def take(out: Path, model: str | None, new_tokens: int, only: str = "all") -> list[Path]:
    """Every picture (`only`: "requests", that one alone), into `out`; the paths written."""
    import qasync
    from PySide6.QtWidgets import QApplication, QToolTip

    from engine.spec import LoadSpec

    from ..core.settings import Settings
    from ..settings_dialog import SettingsDialog, open_settings
    from ..style import apply_style
    from ..window import MainWindow

    out.mkdir(parents=True, exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="kvchat-shots-"))
    os.environ["KVCHAT_DATA_DIR"] = str(data)
    extra = {"temperature": 0.8, "seed": 7} if only == "alternatives" else {}  # alternatives draw, not argmax
    if only == "drafts":
        extra = {"speculative": "lookup", "token_colours": "drafts"}
    if only == "grammar":
        extra = {"reply_format": "json_schema", "reply_grammar": json.dumps(TRIP), "token_colours": "probability"}
    if only == "tools":
        (data / "weather.py").write_text(WEATHER_SERVER)
        servers = {"mcpServers": {"weather": {"command": sys.executable, "args": [str(data / "weather.py")]}}}
        extra = {"mcp_servers": json.dumps(servers), "tools": json.dumps(["weather/get_weather"]),
                 "tool_choice": "required"}  # fmt: skip
    Settings(model=LoadSpec(path=model), max_new_tokens=new_tokens, **extra).save(open_settings(data))
    app = QApplication.instance() or QApplication(["kvchat"])
    apply_style(app)
    loop = qasync.QEventLoop(app, already_running=False)
    asyncio.set_event_loop(loop)
    written: list[Path] = []

    def save(name: str, widget) -> None:
        app.processEvents()
        path = out / f"{name}.png"
        if not widget.grab().save(str(path)):
            raise RuntimeError(f"could not write {path}")
        written.append(path)

    async def wait(pred, timeout=300.0):
        end = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > end:
                raise TimeoutError("the window did not get there in time")
            await asyncio.sleep(0.02)

    async def run() -> None:
        w = MainWindow(data)
        w.resize(*WINDOW)
        w.show()
        ready: list = []
        w.modelReady.connect(ready.append)
        await wait(lambda: ready)
        if ready[0].get("error"):
            raise RuntimeError(ready[0]["error"])
        if only == "requests":
            return await in_flight(w)
        if only == "alternatives":
            return await alternatives(w)
        if only == "drafts":
            return await drafted(w)
        if only == "grammar":
            return await constrained(w)
        if only == "tools":
            return await tool_call(w)
        if only == "images":
            return await pictured(w)
        for text in MESSAGES:
            done: list = []
            w.replyFinished.connect(done.append)
            w.composer.setPlainText(text)
            w.send()
            await wait(lambda done=done: done)
            w.replyFinished.disconnect(done.append)
        w.tokenColours.setCurrentIndex(w.tokenColours.findData("probability"))
        settings = SettingsDialog(w.chat.settings_for(), w.db_path, w)
        models = w.open_models_dialog()
        await wait(lambda: models.table.rowCount() > 0, 60)
        for theme in ("dark", "light"):
            w.set_theme(theme)
            await asyncio.sleep(0.3)
            save(f"reply-footer-meter-{theme}-1000", w)
            settings.show()
            save("settings-sampling" if theme == "dark" else "settings-sampling-light", settings)
            settings.hide()
        w.set_theme("dark")
        models.tabs.setCurrentIndex(0)
        save("models-dialog", models)
        models.tabs.setCurrentIndex(1)
        models.hub.offline.setChecked(True)
        save("hub-offline", models)
        models.close()
        w.close()

    async def in_flight(w) -> None:
        """Three conversations sent one after another; the Requests tab once all three stream (or, on a model too
        fast to catch them, once they ended: the view keeps them)."""
        w.resize(1400, 860)
        for i, text in enumerate(REQUESTS):
            if i:
                w.new_conversation()
            w.composer.setPlainText(text)
            w.send()
            await wait(lambda n=i + 1: len(w.requestsView.listed) >= n or len(w.chat.streams) >= n, 120)
            await asyncio.sleep(0.4)  # a few tokens each, so that the next one's prefill lands beside them
        w.panelTabs.setCurrentWidget(w.requestsView)

        def three_decode() -> bool:
            return sum(st.stats.status == "decoding" for st in w.chat.streams.values()) == 3

        await wait(lambda: three_decode() or not w.chat.busy, 120)
        await asyncio.sleep(0.6)
        w.pacer.draw_now()
        await asyncio.sleep(0.1)
        save("requests-three-in-flight", w)
        w.close()  # the replies stop, what streamed is kept

    async def alternatives(w) -> None:
        """One reply, then Regenerate with… → 3 alternatives; the Requests tab once all three decode."""
        w.resize(1400, 860)
        done: list = []
        w.replyFinished.connect(done.append)
        w.composer.setPlainText(REQUESTS[0])
        w.send()
        await wait(lambda: done, 120)
        three = next(a for a in w.regenerateWith.menu().actions() if a.text() == "3 alternatives")
        three.trigger()
        w.panelTabs.setCurrentWidget(w.requestsView)
        await wait(lambda: sum(st.stats.status == "decoding" for st in w.chat.streams.values()) == 3, 120)
        await asyncio.sleep(0.8)
        w.pacer.draw_now()
        await asyncio.sleep(0.1)
        save("requests-alternatives-shared", w)
        w.close()

    async def drafted(w) -> None:
        """A code rewrite with lookup drafts: the reply coloured by its drafts, the panel's rows beside it."""
        w.resize(1400, 900)
        done: list = []
        w.replyFinished.connect(done.append)
        w.composer.setPlainText(REWRITE)
        w.send()
        await wait(lambda: done, 300)
        w.select_message(w.chat.last_message().id)
        w.pacer.draw_now()
        await asyncio.sleep(0.3)
        w.statsPanel.ensureWidgetVisible(w.statsPanel.draftsBox)
        await asyncio.sleep(0.1)
        save("tokens-drafts", w)
        w.close()

    async def constrained(w) -> None:
        """A reply a JSON schema shaped: a token the grammar forced, its tooltip (the whole screen, where the
        tooltip is a window of its own), and the Settings tab that set it."""
        w.resize(1400, 900)
        done: list = []
        w.replyFinished.connect(done.append)
        w.composer.setPlainText("Plan a short trip: which city, and how many nights?")
        w.send()
        await wait(lambda: done, 300)
        w.select_message(w.chat.last_message().id)
        w.pacer.draw_now()
        w.statsPanel.ensureWidgetVisible(w.statsPanel.grammarBox)
        await asyncio.sleep(0.3)
        view = w.transcript.views[-1].tokenView
        steps = view.steps
        forced = next((i for i, t in enumerate(steps) if (t.get("grammar") or {}).get("preferred_text")), 0)
        view.setFocus()
        view.move_to(forced)
        await asyncio.sleep(0.5)
        screen = app.primaryScreen().grabWindow(0)  # the tooltip with the window under it
        path = out / "tokens-grammar.png"
        if not screen.copy(w.frameGeometry()).save(str(path)):
            raise RuntimeError(f"could not write {path}")
        written.append(path)
        QToolTip.hideText()
        w.tokenColours.setCurrentIndex(w.tokenColours.findData("grammar"))  # what the grammar did, token by token
        await asyncio.sleep(0.5)
        save("tokens-by-grammar", w)
        settings = SettingsDialog(w.chat.settings_for(), w.db_path, w)
        settings.tabs.setCurrentWidget(settings.replyFormat)
        settings.show()
        await asyncio.sleep(0.5)
        save("settings-reply-format", settings)
        settings.close()
        w.close()

    async def tool_call(w) -> None:
        """A call asked, then allowed: its result opened in the transcript and the reply made from it."""
        w.resize(1400, 900)
        done: list = []
        w.replyFinished.connect(done.append)
        w.composer.setPlainText("What is the weather in Paris right now?")
        w.send()
        await wait(lambda: w.approval is not None and w.approval.isVisible(), 300)
        await asyncio.sleep(0.3)
        save("tool-call-question", w.approval)
        w.approval.allowOnce.click()
        await wait(lambda: len(done) >= 2, 300)
        w.pacer.draw_now()
        result = next(v for v in w.transcript.views if v.message.role == "tool")
        result.toolBlock.toggle.click()
        await asyncio.sleep(0.5)
        save("tool-call-approved", w)
        w.close()

    async def pictured(w) -> None:
        """A question about two attached pictures: their thumbnails, and the map's image band under the pointer."""
        from engine.images import image_runs, read_image

        w.resize(1400, 900)
        w.attach_images([read_image(scene(i), f"{name}.png") for i, name in enumerate(("garden", "harbour"))])
        done: list = []
        w.replyFinished.connect(done.append)
        w.composer.setPlainText("What is in these two pictures?")
        save("image-attached", w)
        w.send()
        await wait(lambda: done, 600)
        w.pacer.draw_now()
        runs = image_runs(w.chat.cache_map.ids)
        view = w.statsPanel.cacheMap.grid
        w.statsPanel.ensureWidgetVisible(w.statsPanel.imagesValue, 0, 40)  # the panel scrolled to the map and rows
        if runs:  # the keyboard on a cell of the first image: its words shown as a tooltip under the map
            view.focus_cell(runs[0][0] // max(1, view.per))
        await asyncio.sleep(0.5)
        screen = app.primaryScreen().grabWindow(0)  # the whole screen: the tooltip is a window of its own
        if os.environ.get("QT_QPA_PLATFORM") == "xcb" and not screen.isNull():
            shot = screen.copy(w.frameGeometry())
            shot.save(str(out / "image-reply-map.png"))
            written.append(out / "image-reply-map.png")
        else:
            save("image-reply-map", w)
        w.close()

    with loop:
        loop.run_until_complete(run())
    return written


def scene(seed: int) -> bytes:
    """A picture to ask about: a sky, a sun, ground and a house (a garden), or water and a boat (a harbour)."""
    import io

    from PIL import Image, ImageDraw

    picture = Image.new("RGB", (640, 420), (120, 180, 235))
    d = ImageDraw.Draw(picture)
    d.ellipse((500, 40, 580, 120), fill=(250, 210, 60))
    if seed == 0:
        d.rectangle((0, 280, 640, 420), fill=(80, 160, 70))
        d.rectangle((200, 170, 380, 300), fill=(200, 80, 60))
        d.polygon([(180, 170), (290, 90), (400, 170)], fill=(120, 60, 40))
        d.rectangle((270, 230, 310, 300), fill=(90, 50, 30))
    else:
        d.rectangle((0, 250, 640, 420), fill=(30, 90, 160))
        d.polygon([(220, 300), (420, 300), (390, 340), (250, 340)], fill=(240, 240, 240))
        d.rectangle((315, 200, 320, 300), fill=(80, 60, 40))
        d.polygon([(320, 205), (380, 290), (320, 290)], fill=(250, 250, 250))
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    return buf.getvalue()


def main(argv=None) -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen" if not os.environ.get("DISPLAY") else "xcb")
    ap = argparse.ArgumentParser(prog="python -m desktop.tools.screenshots", description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="where the PNG files go (resources/screenshots for desktop/README.md)")
    ap.add_argument("--model", default=None, help="a model folder or GGUF file (default: the bundled demo model)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--only",
        choices=("all", "requests", "alternatives", "drafts", "grammar", "tools", "images"),
        default="all",
        help="requests, alternatives: the Requests tab alone; drafts: a reply coloured by its drafts; grammar: a "
        "reply a JSON schema shaped, a token's tooltip; tools: a tool call asked, allowed, its result; images: a "
        "question about two pictures, the map's image band",
    )
    ns = ap.parse_args(argv)
    for path in take(ns.out, ns.model, ns.new_tokens, ns.only):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
