"""The Requests view: every reply in flight on the engine (and the last few that ended) — its queue wait, prefill
progress, tokens, its lane's share of the KV bytes, the batch its decode steps ran in — the KV formula summed over
them, and a timeline of their tokens that shows what a newcomer's prefill does to the others' token gaps.

Drawn from the chat controller's streams (their own events) and the engine's lanes (`in_flight`, a snapshot read
between turns); the window calls `show_streams` at the panel's cadence.
"""

from __future__ import annotations

from PySide6.QtCore import QRectF, Qt, QTimer
from PySide6.QtGui import QColor, QPen
from PySide6.QtWidgets import QHeaderView, QLabel, QTreeWidget, QTreeWidgetItem, QVBoxLayout, QWidget

from engine.trace import now

from .core.panel_words import DASH, fmt_ms, fmt_size, percentile
from .core.streams import Stream
from .outside_text import plain
from .panel_parts import CHART_COLOURS, chart_painter
from .style import current_theme

SERVER_EVERY_MS = 1000  # a remote server's own report is asked for this often while the tab is shown
KEEP_ENDED = 6  # replies that ended stay listed (and on the timeline) until this many newer ones came
COLUMNS = ("Queue", "Prefill", "Tokens", "KV", "Batch")  # under each request's name and state
STATE_WORDS = {"prefill": "prefilling", "decoding": "decoding", "finished": "finished", "cancelled": "stopped",
               "failed": "failed"}  # fmt: skip
TIMELINE_COLOURS = {  # the gap chart's background, words and bars (a token); waiting, prefilling, and the bands
    theme: {"back": c["back"], "words": c["words"], "token": c["bar"], **own}  # where a prefill ran beside decoding
    for theme, c, own in (
        ("dark", CHART_COLOURS["dark"], {"wait": "#4a5162", "prefill": "#f0c05a", "band": "#3a3422"}),
        ("light", CHART_COLOURS["light"], {"wait": "#c3c8d2", "prefill": "#d09a20", "band": "#f5ead0"}),
    )
}


def state_of(st: Stream) -> str:
    """waiting (for a lane: no prefill yet), prefilling, decoding, or how it ended."""
    if st.stats.status == "prefill":
        return "prefilling" if st.lane is not None else "waiting"
    return STATE_WORDS.get(st.stats.status, st.stats.status)


def queue_ms(st: Stream) -> float | None:
    """Its wait for a lane: the engine's own figure once it ended, else from Send to its prefill's start."""
    trace = st.stats.trace or {}
    if trace.get("ttft_queue_ms") is not None:
        return trace["ttft_queue_ms"]
    if st.prefill_at is None or st.stats.arrival is None:
        return None
    return (st.prefill_at - st.stats.arrival) * 1000


def prefill_span(st: Stream) -> tuple[float, float] | None:
    """When its prompt was prefilled (trace.now): from its prefill's start to its first token, or to now while it
    still prefills; None before it started, and for one that ended without a token."""
    if st.prefill_at is None:
        return None
    if st.stats.token_times:
        return st.prefill_at, st.stats.token_times[0]
    return (st.prefill_at, now()) if st.stats.status == "prefill" else None


def gaps_beside(streams: list[Stream], newcomer: Stream) -> tuple[float, float] | None:
    """The other replies' median token gap (ms) while `newcomer`'s prompt was prefilled, and in as long a window
    just before it; None when no other reply decoded on both sides."""
    span = prefill_span(newcomer)
    if span is None or span[1] <= span[0]:
        return None
    start, end = span
    during, before = [], []
    back = start - max(end - start, 1.0)  # "before": as long as the prefill, and at least a second
    for st in streams:
        if st is newcomer:
            continue
        times = st.stats.token_times
        for a, b in zip(times, times[1:]):
            if start < b <= end:  # a gap that ended while the prompt was prefilled (one it began in included)
                during.append((b - a) * 1000)
            elif back <= a and b <= start:
                before.append((b - a) * 1000)
    if not during or not before:
        return None
    return percentile(during, 0.5), percentile(before, 0.5)


def sum_formula(facts: dict, positions: list[int], shared: int = 0) -> str:
    """The KV formula with the sum over requests: 2·L·(T₁ + T₂ + … − S)·H_kv·d·b, S the positions the KV pool holds
    once for several of them (a shared prompt's blocks), for a cache of the model's dtype without sliding layers
    (else the lanes' own counts say it)."""
    if not facts or facts.get("kv_layer_kinds") or facts.get("kv_cache", "none") != "none" or not positions:
        return ""
    need = ("layers", "kv_heads", "head_dim", "bytes_per_value")
    if any(facts.get(k) is None for k in need):
        return ""
    total = sum(positions) - shared
    terms = " + ".join(f"{t:,}" for t in positions) + (f" − {shared:,} shared" if shared else "")
    latent = facts.get("latent")
    if latent:  # latent attention: L · (T₁ + T₂ + …) · (d_c + d_r) · b
        dc, dr, b = latent["kv_lora_rank"], latent["rope_dim"], facts["bytes_per_value"]
        return f"{facts['layers']} · ({terms}) · ({dc} + {dr}) · {b} = {facts['layers'] * (dc + dr) * b * total:,} B"
    per = 2 * facts["layers"] * facts["kv_heads"] * facts["head_dim"] * facts["bytes_per_value"]
    return (f"2 · {facts['layers']} · ({terms}) · {facts['kv_heads']} · {facts['head_dim']} · "
            f"{facts['bytes_per_value']} = {per * total:,} B")  # fmt: skip


class Timeline(QWidget):
    """One row a request: its wait (grey), its prefill (amber), a tick at each token; shaded, the spans where a
    prompt was prefilled while another request decoded — where the others' ticks spread apart."""

    ROW = 16

    def __init__(self):
        super().__init__()
        self.setObjectName("requestsTimeline")
        self.streams: list[Stream] = []
        self.bands: list[tuple[float, float]] = []  # prefill spans beside decoding streams (gaps_beside said so)
        self.setMinimumHeight(self.ROW * 3 + 20)
        self.setToolTip(
            "Each row is a request, in the table's order, from Send (left) to now (right): grey while it waits "
            "for a lane, amber while its prompt is prefilled, a tick at each token. The shaded spans are prefills "
            "beside running streams: their ticks spread there, the token gaps a newcomer's prompt stretches."
        )

    def show_streams(self, streams: list[Stream], bands: list[tuple[float, float]]) -> None:
        self.streams, self.bands = streams, bands
        self.setMinimumHeight(self.ROW * max(3, len(streams)) + 20)
        self.update()

    def span(self) -> tuple[float, float]:
        starts = [st.stats.arrival for st in self.streams if st.stats.arrival is not None]
        ends = [st.stats.token_times[-1] for st in self.streams if st.stats.token_times]
        live = any(st.stats.status in ("prefill", "decoding") for st in self.streams)
        t1 = now() if live or not ends else max(ends)
        t0 = min(starts) if starts else t1 - 1
        return t0, max(t1, t0 + 1e-3)

    def paintEvent(self, e) -> None:
        colours = TIMELINE_COLOURS[current_theme()]
        p = chart_painter(self, colours, None if self.streams else "no request yet")
        if p is None:
            return
        t0, t1 = self.span()
        w = self.width() - 8

        def x(t: float) -> float:
            return 4 + (t - t0) / (t1 - t0) * w

        for a, b in self.bands:  # prefills beside decoding: bands over every row
            p.fillRect(QRectF(x(a), 0, max(1.0, x(b) - x(a)), self.height() - 16), QColor(colours["band"]))
        for row, st in enumerate(self.streams):
            y = row * self.ROW + 3
            s = st.stats
            begin = st.prefill_at if st.prefill_at is not None else (now() if s.status == "prefill" else None)
            if s.arrival is not None and begin is not None:
                p.fillRect(QRectF(x(s.arrival), y + 4, max(1.0, x(begin) - x(s.arrival)), 4), QColor(colours["wait"]))
            span = prefill_span(st)
            if span is not None:
                p.fillRect(QRectF(x(span[0]), y + 2, max(1.0, x(span[1]) - x(span[0])), 8), QColor(colours["prefill"]))
            p.setPen(QPen(QColor(colours["token"]), 1))
            for t in s.token_times:
                p.drawLine(int(x(t)), y, int(x(t)), y + 12)
        p.setPen(QColor(colours["words"]))
        p.drawText(QRectF(4, self.height() - 15, w, 14), Qt.AlignLeft, "Send")
        p.drawText(QRectF(4, self.height() - 15, w, 14), Qt.AlignRight, f"{(t1 - t0):.2f} s later")


def _label(name: str, text: str = "") -> QLabel:
    label = plain(QLabel(text))
    label.setObjectName(name)
    label.setWordWrap(True)
    return label


def _table(name: str) -> QTreeWidget:
    """Two lines a request: its state and name across the columns, then its figures under them (`_add`)."""
    table = QTreeWidget()
    table.setObjectName(name)
    table.setHeaderLabels(list(COLUMNS))
    table.setRootIsDecorated(False)
    table.setIndentation(0)
    table.setUniformRowHeights(True)
    table.header().setSectionResizeMode(QHeaderView.ResizeToContents)
    table.header().setStretchLastSection(True)
    table.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
    return table


def _add(table: QTreeWidget, head: str, cells: list[str]) -> QTreeWidgetItem:
    """A request's two lines; its figures' line, for tooltips."""
    top = QTreeWidgetItem([head])
    row = QTreeWidgetItem(cells)
    top.addChild(row)
    table.addTopLevelItem(top)
    top.setFirstColumnSpanned(True)
    top.setExpanded(True)
    return row


class RequestsView(QWidget):
    """The panel's Requests tab."""

    def __init__(self):
        super().__init__()
        self.setObjectName("requestsView")
        lay = QVBoxLayout(self)
        self.summary = _label("requestsSummary", "No request in flight")
        lay.addWidget(self.summary)
        self.formula = _label("requestsFormula")
        self.formula.setToolTip(
            "The KV cache of every request at once: the seed's formula with the sum of the positions each request's "
            "cache holds in place of B·T (each request runs on a lane of its own, with its own cache)."
        )
        lay.addWidget(self.formula)
        self.table = _table("requestsTable")
        self.table.setMinimumHeight(120)
        lay.addWidget(self.table)
        self.timeline = Timeline()
        lay.addWidget(self.timeline)
        self.serverLine = _label("requestsServer")  # a remote server's own report of what it runs (all its clients)
        self.serverLine.setVisible(False)
        lay.addWidget(self.serverLine)
        self.serverTable = _table("requestsServerTable")
        self.serverTable.setVisible(False)
        lay.addWidget(self.serverTable)
        self.provider = None  # a remote server's load report, latest (EngineClient.server_load); None: local
        self.serverTimer = QTimer(self)
        self.serverTimer.setInterval(SERVER_EVERY_MS)
        self.serverTimer.timeout.connect(self.show_server)
        self.gapNote = _label("requestsGapNote")
        lay.addWidget(self.gapNote)
        lay.addStretch(1)
        self.facts: dict = {}
        self.listed: dict[int, Stream] = {}  # message id → stream, in the order they started (ended ones kept)

    def show_model(self, facts: dict, provider=None) -> None:
        """The engine in use; `provider`: a remote server's load report (None: a local engine)."""
        self.facts, self.provider = facts or {}, provider
        remote = provider is not None
        self.serverLine.setVisible(remote)
        self.serverTable.setVisible(False)
        if remote:
            self.serverLine.setText(f"{self.facts.get('server_kind', 'the server')}'s own report: asking…")
            if self.isVisible():
                self.serverTimer.start()
        else:
            self.serverTimer.stop()

    def showEvent(self, e) -> None:
        super().showEvent(e)
        if self.provider is not None:  # asked only while someone looks
            self.show_server()
            self.serverTimer.start()

    def hideEvent(self, e) -> None:
        super().hideEvent(e)
        self.serverTimer.stop()

    def show_server(self) -> None:
        """What the remote server says it runs, for all its clients (engine.http.server_load)."""
        report = None if self.provider is None else self.provider()
        if report is None:
            return
        kind = self.facts.get("server_kind", "the server")
        if report.get("error"):
            self.serverLine.setText(f"{kind}'s own report: not available ({report['error']})")
            self.serverTable.setVisible(False)
            return
        parts = []
        if report.get("running") is not None:
            of = f" of {report['parallel']}" if report.get("parallel") else ""
            parts.append(f"{report['running']}{of} running")
        if report.get("waiting") is not None:
            parts.append(f"{report['waiting']} waiting")
        if report.get("kv_usage") is not None:
            parts.append(f"KV cache {report['kv_usage']:.0%} used")
        said = ", ".join(parts) or "nothing kvchat reads"
        self.serverLine.setText(f"{kind}'s own report ({report['source']}), all its clients: {said}")
        rows = report.get("requests") or []
        self.serverTable.clear()
        for r in rows:
            prefill = r.get("prefill") or (None, None)
            q = r.get("queue_ms")
            cells = [DASH if q is None else f"{q:,.0f} ms",
                     DASH if prefill[1] is None else f"{prefill[0] or 0:,}/{prefill[1]:,}",
                     DASH if r.get("tokens") is None else f"{r['tokens']:,}",
                     DASH if r.get("kv_payload_bytes") is None else fmt_size(r["kv_payload_bytes"]),
                     DASH if not r.get("batch_size") else str(r["batch_size"])]  # fmt: skip
            _add(self.serverTable, f"{r.get('state', '?')} · {r.get('label', '?')}", cells)
        self.serverTable.setVisible(bool(rows))

    def show_streams(self, chat, in_flight: list[dict], pool: dict | None = None) -> None:
        """The replies streaming now (chat.streams) and the last that ended; `in_flight`: the engine's lanes; `pool`:
        the KV pool under them (Lanes.pool_stats: a block several hold counted once), None without one."""
        for mid, st in chat.streams.items():
            self.listed.setdefault(mid, st)
        ended = [mid for mid, st in self.listed.items() if mid not in chat.streams]
        for mid in ended[: max(0, len(ended) - KEEP_ENDED)]:
            del self.listed[mid]
        streams = list(self.listed.values())
        lanes = {r["lane"]: r for r in in_flight}
        running = [st for st in streams if st.mid in chat.streams]
        live = [lanes[st.lane] for st in running if st.lane in lanes]
        shared = pool["shared_positions"] if pool and live else 0
        payload = pool["payload_bytes"] if pool and live else sum(r["kv_payload_bytes"] for r in live)
        allocated = pool["held_bytes"] if pool and live else sum(r["kv_allocated_bytes"] for r in live)
        waiting = sum(1 for st in running if state_of(st) == "waiting")
        batch = max((r["batch_size"] or 0 for r in live), default=0)
        if running:
            held = f" in {allocated // pool['block_bytes']:,} blocks of the pool" if pool and live else " allocated"
            once = f" ({shared:,} positions shared, held once)" if shared else ""
            # in flight: on a lane of the engine's (the formula's terms) or waiting for one; a reply the engine has
            # finished while its last tokens are still on their way to the window is neither
            self.summary.setText(
                f"{len(live) + waiting} in flight ({waiting} waiting for a lane) · decode batch {batch or DASH} · "
                f"KV {fmt_size(payload)} payload{once}, {fmt_size(allocated)}{held}"
            )
        else:
            self.summary.setText("No request in flight" + (" · the last ones below" if streams else ""))
        formula = sum_formula(self.facts, [r["cache_positions"] for r in live], shared)
        self.formula.setText(f"Σ over requests: {formula}" if formula and len(live) > 1 else formula)
        self._fill(streams, lanes, payload, chat)
        beside = [(st, gaps_beside(streams, st)) for st in streams]  # once a redraw, for the bands and the note
        self.timeline.show_streams(streams, [prefill_span(st) for st, gaps in beside if gaps is not None])
        self._note(beside)

    def _fill(self, streams: list[Stream], lanes: dict, payload: int, chat) -> None:
        self.table.setUpdatesEnabled(False)
        self.table.clear()
        for st in streams:
            s, lane = st.stats, lanes.get(st.lane) if st.mid in chat.streams else None
            alt = st.alternative
            name = f"“{st.title}”" + (f" · alternative {alt[0]}/{alt[1]}" if alt else "")
            q = queue_ms(st)
            reused = (s.reuse or {}).get("reused", 0)
            share, share_tip = DASH, "its lane's K/V: not held now"
            if lane is not None:
                part = lane["kv_payload_bytes"]
                share = fmt_size(part)
                common = lane.get("shared_positions") or 0
                share_tip = f"{part:,} B of K/V in its lane's cache ({lane['cache_positions']:,} positions)" + (
                    f", {common:,} of them in blocks held once for it and others" if common else "") + (
                    f"; all requests' together: {payload:,} B" if payload else "")  # fmt: skip
            sizes = (s.trace or {}).get("batch_sizes") or []
            batch = str(lane["batch_size"]) if lane and lane.get("batch_size") else (
                f"{sum(sizes) / len(sizes):.1f}" if sizes else DASH)  # fmt: skip
            prefill = f"{s.prefill_done:,}/{s.prefill_total:,}"
            cells = [DASH if q is None else f"{q:,.0f} ms", prefill, f"{s.tokens:,}", share, batch]
            row = _add(self.table, f"{state_of(st)} · {name}", cells)  # the state first: a long name is cut, not it
            row.setToolTip(1, f"prompt positions computed of those to compute; {reused:,} reused")
            row.setToolTip(3, share_tip)
            row.setToolTip(4, "sequences in its last decode step" if lane else "mean sequences a decode step")
        self.table.setUpdatesEnabled(True)

    def _note(self, beside: list[tuple[Stream, tuple[float, float] | None]]) -> None:
        """The chapter's effect in words: the newest prefill beside running streams, and their gaps then."""
        for st, got in reversed(beside):
            if got is not None:
                during, before = got
                self.gapNote.setText(
                    f"While “{st.title}” was prefilled, the other streams' token gaps were {fmt_ms(during)} "
                    f"(median) against {fmt_ms(before)} just before: {during / before:.1f}×."
                )
                return
        self.gapNote.setText("")
