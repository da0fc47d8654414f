"""`python -m desktop.tools.history_bench`: does a long history slow the window down?

A database holds one conversation of N messages (and a short one); the real window (offscreen, styled
as the app is) opens on it, switches to and from it, and sends in it, while a 10 ms timer on the GUI
thread measures how long the event loop stalls. Each figure is set beside the same step on an empty
database or the short conversation, in the same run. desktop/README.md, "Long conversations", says what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

TICK_MS = 10
WORDS = (
    "the cache keeps every position it has seen and drops none of them until the prompt changes so a reply "
    "that follows an edit reuses what came before the first changed token and recomputes only the rest"
).split()


def _text(rnd: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        w = rnd.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def fill(path: Path, messages: int, chars: int) -> dict:
    """A database with a short conversation and a long one of `messages` messages (user and assistant in
    turn, each `chars` characters, every reply with a trace as the app stores it)."""
    from ..core.store import Store

    rnd = random.Random(7)
    st = Store(path)
    trace = json.dumps({"ttft_ms": 52.1, "tpot_ms": 9.8, "decode_tok_s": 102.0, "new_tokens": 64, "stop": "eos"})
    short = st.new_conversation("Short")
    u = st.add_message(short.id, None, "user", "Hello there")
    st.add_message(short.id, u.id, "assistant", "Hello! How can I help?")
    long = st.new_conversation(f"Long ({messages} messages)")
    now = time.time()
    with st.db:  # one transaction: a fill of 10,000 rows in a second, not a minute
        st.db.execute("BEGIN")
        parent = None
        for i in range(messages):
            role = "user" if i % 2 == 0 else "assistant"
            cur = st.db.execute(
                "INSERT INTO messages(conversation_id, parent_id, role, content, status, token_count, created, "
                "trace) VALUES (?,?,?,?,?,?,?,?)",
                (long.id, parent, role, _text(rnd, chars), "complete", chars // 4, now + i,
                 trace if role == "assistant" else None),
            )  # fmt: skip
            parent = cur.lastrowid
        st.db.execute("UPDATE conversations SET leaf_id=?, updated=? WHERE id=?", (parent, now + messages, long.id))
    st.close()
    return {"short": short.id, "long": long.id}


class Probe:
    """The real window on the qasync loop with a lag probe (a timer on the GUI thread)."""

    def __init__(self, data: Path, model: str):
        import qasync
        from PySide6.QtCore import QTimer
        from PySide6.QtWidgets import QApplication

        from engine.spec import LoadSpec
        from engine.trace import now

        from ..core.settings import Settings
        from ..settings_dialog import open_settings
        from ..style import apply_style

        self.now = now
        os.environ["KVCHAT_DATA_DIR"] = str(data)
        Settings(model=LoadSpec(path=model), max_new_tokens=16, temperature=0.0).save(open_settings(data))
        self.app = QApplication.instance() or QApplication([])
        apply_style(self.app)
        self.loop = qasync.QEventLoop(self.app, already_running=False)
        asyncio.set_event_loop(self.loop)
        self.ticks: list[float] = []
        self.timer = QTimer()
        self.timer.setInterval(TICK_MS)
        self.timer.timeout.connect(lambda: self.ticks.append(now()))
        self.window = None

    def open(self, data: Path) -> float:
        """Milliseconds from constructing the window to it shown and painted."""
        from ..app import tune_process
        from ..window import MainWindow

        t0 = self.now()
        self.window = MainWindow(data)
        self.window.resize(1400, 900)
        self.window.show()
        tune_process(self.window)  # as the app does
        self._settle()
        return 1000 * (self.now() - t0)

    def _settle(self) -> None:
        """Let Qt lay out and paint what is pending (offscreen: the paint happens in these passes of the
        event loop; each pass adds up to a millisecond to the figure)."""
        for _ in range(3):
            self.run(asyncio.sleep(0.001))

    def wait_ready(self) -> None:
        self.run(self._until(lambda: self.window.facts is not None, 300))

    async def _until(self, pred, timeout: float) -> None:
        end = self.now() + timeout
        while not pred():
            if self.now() > end:
                raise TimeoutError("the app did not answer in time")
            await asyncio.sleep(0.01)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def step(self, action) -> dict:
        """`action` on the GUI thread, then 0.3 s of the event loop: its duration until painted, and the
        longest the loop stalled from the action to the end (timer gaps beyond the tick)."""
        self.ticks.clear()
        self.timer.start()
        self.run(asyncio.sleep(0.05))
        t0 = self.now()
        self.ticks.append(t0)
        action()
        self._settle()
        took = 1000 * (self.now() - t0)
        self.run(asyncio.sleep(0.3))
        self.timer.stop()
        gaps = [b - a for a, b in zip(self.ticks, self.ticks[1:]) if b >= t0]
        stall = max((1000 * g - TICK_MS for g in gaps), default=0.0)
        return {"ms": took, "stall_ms": max(0.0, stall)}

    def pick(self, cid: int) -> None:
        """Open a conversation as a click on it in the list does."""
        from PySide6.QtCore import Qt

        lst = self.window.conversationList
        item = next(lst.item(i) for i in range(lst.count()) if lst.item(i).data(Qt.UserRole) == cid)
        lst.setCurrentItem(item)

    def send(self, text: str) -> dict:
        """Send, and measure the GUI thread until the click returns and the loop runs again (not the reply)."""
        got = []
        self.window.replyFinished.connect(got.append)
        self.window.composer.setPlainText(text)
        out = self.step(self.window.send)
        self.run(self._until(lambda: got, 600))
        self.window.replyFinished.disconnect(got.append)
        return out

    def close(self) -> None:
        if self.window is not None:
            self.window.close()
            self.run(asyncio.sleep(0.05))
            self.window = None


def measure(messages: int, chars: int, repeats: int, model: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvchat-history-") as tmp:
        empty, full = Path(tmp) / "empty", Path(tmp) / "full"
        empty.mkdir()
        full.mkdir()
        t0 = time.perf_counter()
        ids = fill(full / "kvchat.db", messages, chars)
        fill_s = time.perf_counter() - t0
        probe = Probe(empty, model)
        rows: dict[str, list] = {k: [] for k in ("open_empty", "open_full", "to_long", "to_short", "send_long")}
        try:
            for r in range(repeats):
                os.environ["KVCHAT_DATA_DIR"] = str(empty)
                rows["open_empty"].append({"ms": probe.open(empty), "stall_ms": None})
                probe.wait_ready()
                probe.close()
                os.environ["KVCHAT_DATA_DIR"] = str(full)
                rows["open_full"].append({"ms": probe.open(full), "stall_ms": None})  # it opens on the long one
                probe.wait_ready()
                for _ in range(2):
                    rows["to_short"].append(probe.step(lambda: probe.pick(ids["short"])))
                    rows["to_long"].append(probe.step(lambda: probe.pick(ids["long"])))
                if r == 0:
                    rows["send_long"].append(probe.send("One more question"))
                probe.close()
        finally:
            probe.close()

    def summary(key):
        ms = [x["ms"] for x in rows[key]]
        stalls = [x["stall_ms"] for x in rows[key] if x["stall_ms"] is not None]
        return {
            "ms_p50": round(statistics.median(ms), 1),
            "ms_max": round(max(ms), 1),
            "stall_ms_p50": round(statistics.median(stalls), 1) if stalls else None,
            "stall_ms_max": round(max(stalls), 1) if stalls else None,
        }

    return {"messages": messages, "chars": chars, "fill_s": round(fill_s, 2), **{k: summary(k) for k in rows}}


def main(argv=None) -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    ap = argparse.ArgumentParser(prog="python -m desktop.tools.history_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--messages", default="1000,10000", help="the long conversation's sizes, comma-separated")
    ap.add_argument("--chars", type=int, default=400, help="characters per message")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="a model folder or GGUF file (default: the bundled demo model)")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args(argv)
    from engine.weights.bundled import DEMO_MODEL

    model = ns.model or str(DEMO_MODEL)
    try:
        sizes = [int(x) for x in ns.messages.split(",") if x.strip()]
    except ValueError:
        print(f"error: --messages takes whole numbers separated by commas, not {ns.messages!r}", file=sys.stderr)
        return 2
    report = [measure(n, ns.chars, ns.repeats, model) for n in sizes]
    if ns.json:
        print(json.dumps(report))
        return 0
    print(
        f"{ns.repeats} repeats · {ns.chars} characters a message · stalls: the GUI loop's longest gap over {TICK_MS} ms"
    )
    names = {
        "open_empty": "window, empty database",
        "open_full": "window, opening on the long one",
        "to_long": "switch to the long one",
        "to_short": "switch to the short one",
        "send_long": "Send in the long one",
    }
    for r in report:
        print(f"{r['messages']} messages (database filled in {r['fill_s']} s)")
        for key, name in names.items():
            s = r[key]
            stall = (
                "" if s["stall_ms_max"] is None else f", GUI stall p50 {s['stall_ms_p50']} max {s['stall_ms_max']} ms"
            )
            print(f"  {name:34s} {s['ms_p50']:8.1f} ms p50 (max {s['ms_max']}){stall}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
