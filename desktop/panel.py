"""The inference panel: timing, the KV cache in positions and bytes, reuse after an edit, token gaps.

It only shows a plain `ReplyStats` (replies.py) it is handed, in the words of panel_words.py; the window decides
when.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFormLayout,
    QGroupBox,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QTreeWidget,
    QVBoxLayout,
    QWidget,
)

from .cache_map_view import CacheMapView
from .core.panel_help import PICTURE_HELP, ROW_HELP
from .core.panel_words import (
    DASH,
    DRAFT_ROWS,
    GRAMMAR_ROWS,
    MODEL_ROWS,
    NOT_REPORTED,
    SESSION_ROWS,
    cached_words,
    disk_words,
    draft_rows,
    dropped_words,
    fmt_bytes,
    fmt_figure,
    fmt_ms,
    fmt_rate,
    fmt_size,
    formula_title,
    grammar_rows,
    image_words,
    kv_formula,
    percentile,
    reuse_source,
    server_timing,
    state_words,
    ttft_parts,
)
from .outside_text import breakable, plain, plain_tooltip
from .panel_parts import GapChart, Refit, add_store_segment, set_bar

PANEL_WORD = 16  # characters: a value's word longer than this gets places to wrap (the panel never scrolls sideways)

SAME_CACHE = ("name", "backend", "server", "capacity", "dtype", "kv_cache")  # facts that, equal, mean one cache
NOT_REPORTED_LOGPROBS = "not reported by this server"  # a remote server that sends no logprobs
REUSE_ROWS = (
    "firstInvalidatedValue",
    "tokenChangeValue",
    "reuseSourceValue",
    "reusedValue",
    "recomputedValue",
    "discardedValue",
    "reuseReasonValue",
    "droppedValue",
)


class StatsPanel(QScrollArea):
    exportRequested = Signal()

    def __init__(self):
        super().__init__()
        self.setObjectName("statsPanel")
        self.setWidgetResizable(True)
        self.setMinimumWidth(330)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)  # long values wrap (breakable), never scroll
        body = QWidget()
        self.setWidget(body)
        lay = QVBoxLayout(body)
        self.values: dict[str, QLabel] = {}
        self.refit = Refit(body)

        self.heading = plain(QLabel("No reply yet"))
        self.heading.setObjectName("panelHeading")
        self.heading.setWordWrap(True)
        self.heading.setToolTip(  # the app's own words
            "Which reply these figures describe: its state, its conversation, its place in the branch, and "
            "the engine and model that made it. Click a reply, or Ctrl+Up/Down, for another one's."
        )
        lay.addWidget(self.heading)

        self.timingBox = self._group(
            lay,
            "Timing",
            [
                ("ttftValue", "TTFT (from Send)"),
                ("ttftPartsValue", "  TTFT's parts"),
                ("onScreenValue", "On screen (token 1 painted)"),
                ("tpotValue", "TPOT (after token 1)"),
                ("tokensPerSecondValue", "Tokens/s after the first"),
                ("e2eValue", "End to end"),
                ("meanInclWaitValue", "Mean per token incl. wait"),
                ("prefillRateValue", "Prefill rate (computed only)"),
                ("tokensValue", "Tokens"),
                ("serverTimingValue", "Server-side"),
            ],
        )
        self.timingBox.setObjectName("timingBox")
        self.confidenceBox = self._group(
            lay,
            "Confidence",
            [
                ("meanLogprobValue", "Mean log-probability"),
                ("perplexityValue", "Perplexity"),
                ("lowConfidenceValue", "Low-confidence tokens (p < 0.5)"),
            ],
        )
        self.confidenceBox.setObjectName("confidenceBox")

        cache_box = QGroupBox("KV cache")
        form = QFormLayout(cache_box)
        form.setRowWrapPolicy(QFormLayout.WrapLongRows)
        self.cacheBar = QProgressBar()
        self.cacheBar.setObjectName("cacheBar")
        self.cacheBar.setTextVisible(True)
        form.addRow(self.cacheBar)
        self.cacheMap = CacheMapView()
        form.addRow(self.cacheMap)
        for name, label in [
            ("cachePositionsValue", "Cached positions"),
            ("kvPayloadValue", "Payload"),
            ("kvAllocatedValue", "Allocated"),
            ("kvPerPositionValue", "Per position"),
            ("imagesValue", "Images"),
            ("stateValue", "State"),
            ("kvFormulaValue", formula_title({})),
            ("cachePointValue", "Measured"),
        ]:
            self._row(form, name, label)
        self.cacheForm = form  # (the formula row's title: latent attention's formula has its own)
        lay.addWidget(cache_box)

        self._group(
            lay,
            "Reuse",
            [
                ("reuseSourceValue", "Reused from"),
                ("firstInvalidatedValue", "First invalidated position"),
                ("tokenChangeValue", "Cached → new token"),
                ("reusedValue", "Positions reused"),
                ("recomputedValue", "Positions recomputed"),
                ("discardedValue", "Discarded from the working cache"),
                ("reuseReasonValue", "Reason"),
                ("droppedValue", "Left out to fit the cache"),
            ],
        )

        store_box = QGroupBox("Prefix store")
        sf = QFormLayout(store_box)
        sf.setRowWrapPolicy(QFormLayout.WrapLongRows)
        self.storeBar = QProgressBar()
        self.storeBar.setObjectName("storeBar")
        self.storeBar.setTextVisible(True)
        self.storeBar.setFormat("empty")
        sf.addRow(self.storeBar)
        for name, label in [
            ("storeBytesValue", "Held · budget"),
            ("storePrefixesValue", "Prefixes"),
            ("storeEvictionsValue", "Evicted"),
            ("diskValue", "On disk"),
            ("conversationCachedValue", "This conversation"),
        ]:
            self._row(sf, name, label)
        self.storeTree = QTreeWidget()
        self.storeTree.setObjectName("storeTree")
        self.storeTree.setHeaderLabels(["Prefix", "Positions", "Size", "Disk"])
        self.storeTree.setRootIsDecorated(True)
        self.storeTree.setIndentation(12)
        self.storeTree.setMinimumHeight(120)
        self.storeTree.setUniformRowHeights(True)
        for w in (self.cacheBar, self.storeBar, self.storeTree):  # what each picture shows, in words
            w.setToolTip(plain_tooltip(PICTURE_HELP[w.objectName()]))
        header = self.storeTree.header()
        header.setSectionResizeMode(0, QHeaderView.Stretch)
        header.setSectionResizeMode(1, QHeaderView.ResizeToContents)
        header.setSectionResizeMode(2, QHeaderView.ResizeToContents)
        header.setSectionResizeMode(3, QHeaderView.ResizeToContents)
        header.setStretchLastSection(False)
        sf.addRow(self.storeTree)
        lay.addWidget(store_box)

        gaps_box = QGroupBox("Gaps between tokens")
        gl = QVBoxLayout(gaps_box)
        self.gapChart = GapChart()
        gl.addWidget(self.gapChart)
        self.gapStats = plain(QLabel(DASH))
        self.gapStats.setObjectName("gapStatsValue")
        gl.addWidget(self.gapStats)
        lay.addWidget(gaps_box)
        self.draftsBox = self._group(lay, "Speculative decoding", DRAFT_ROWS)
        self.draftsBox.setObjectName("draftsBox")
        self.grammarBox = self._group(lay, "Structured output", GRAMMAR_ROWS)
        self.grammarBox.setObjectName("grammarBox")

        self._group(lay, "Model in use", MODEL_ROWS)
        self._group(lay, "Session", SESSION_ROWS)
        self.exportButton = QPushButton("Export this reply's trace…")
        self.exportButton.setObjectName("exportTraceButton")
        self.exportButton.clicked.connect(self.exportRequested)
        lay.addWidget(self.exportButton)
        lay.addStretch(1)
        self.facts: dict = {}
        self.drafting = ""  # the draft the settings name now (Settings.speculative), for a reply made without one
        self.reply_format = ""  # the conversation's reply format now, in words, for a reply made without one

    def _row(self, form, name, label):
        v = plain(QLabel(DASH))
        v.setObjectName(name)
        v.setAccessibleName(label.strip())  # a screen reader says the row's label with its value
        v.setTextInteractionFlags(Qt.TextSelectableByMouse)
        v.setWordWrap(True)
        form.addRow(label, v)
        help_text = ROW_HELP[name]  # what the row measures: a tooltip on the row, a description for screen readers
        v.setAccessibleDescription(help_text)
        for w in (v, form.labelForField(v)):
            w.setToolTip(plain_tooltip(help_text))  # rich text: word-wrapped, not one line across the screen
        self.values[name] = v
        setattr(self, name, v)

    def _group(self, lay, title, rows):
        box = QGroupBox(title)
        form = QFormLayout(box)
        form.setRowWrapPolicy(QFormLayout.WrapLongRows)  # a row too wide for the panel puts its value below
        for name, label in rows:
            self._row(form, name, label)
        lay.addWidget(box)
        return box

    def set(self, name: str, text: str) -> None:
        label = self.values[name]
        text = breakable(text, PANEL_WORD)
        if label.text() != text:  # an unchanged label costs no relayout (the GUI shares the CPU with the engine)
            label.setText(text)
            self.refit.mark()

    # --- what is shown -------------------------------------------------------------------
    @property
    def remote(self) -> bool:
        return self.facts.get("backend") == "remote"

    def _timing_labels(self, remote: bool) -> None:
        """The timing rows as measured where the reply was made: here, or across the network."""
        title = "Timing · client-side (network included)" if remote else "Timing"
        if self.timingBox.title() != title:  # unchanged: no relayout
            self.timingBox.setTitle(title)

    def show_model(self, facts: dict) -> None:
        """A local model's facts, or a remote server's: what it does not say shows as not reported."""
        self.facts = facts
        unknown = NOT_REPORTED if facts.get("backend") == "remote" else DASH
        self._timing_labels(self.remote)
        self.set("serverTimingValue", unknown if self.remote else "same process")
        self.set("modelNameValue", facts.get("name", DASH))
        kinds = facts.get("attention_kinds")  # windows per layer kind, caps, scales (a family's own)
        self.set("architectureValue", (facts.get("architecture") or unknown) + (f"\n{kinds}" if kinds else ""))
        n, active = facts.get("parameters"), facts.get("active_parameters")
        text = unknown if n is None else f"{n:,}"
        if facts.get("experts"):  # a mixture computes with its routed experts only
            text += f"\n{active:,} active per token ({facts['experts']} experts)"
        self.set("parametersValue", text)
        self.set("dtypeValue", facts.get("dtype") or unknown)
        weights = facts.get("weights", "none")
        if weights != "none" and facts.get("head_weights", "none") != "none":
            weights += f", head {facts['head_weights']}"  # which tensors take which precision
        if facts.get("activations") == "int8":  # decode's products on int8 activations (a named approximation)
            weights += ", int8 activations"
        self.set("precisionValue", f"{weights} · {facts.get('kv_cache', 'none')}")
        read = facts.get("active_weight_bytes")
        self.set(
            "weightBytesValue",
            fmt_bytes(facts.get("weight_bytes"))
            + (f"\n{fmt_bytes(read)} read per token" if facts.get("experts") and read is not None else ""),
        )
        held = facts.get("file_tensors")  # a GGUF's tensors by type: kept as codes, or dequantized and at what cost
        self.set(
            "fileTensorsValue",
            "safetensors"
            if not held
            else "\n".join(
                f"{kind}: {row['tensors']} tensors, {fmt_size(row['file_bytes'])} → {fmt_size(row['held_bytes'])}"
                for kind, row in sorted(held.items(), key=lambda kv: -kv[1]["held_bytes"])
            ),
        )
        self.set("deviceValue", facts["device"])
        self.set("kernelsValue", facts.get("decode_kernels") or unknown)
        self.set("layersValue", str(facts.get("layers") or unknown))
        heads = (facts.get("kv_heads"), facts.get("heads"))
        self.set("kvHeadsValue", unknown if None in heads else f"{heads[0]} · {heads[1]}")
        self.set("headDimValue", str(facts.get("head_dim") or unknown))
        if self.remote and facts.get("server_kind") != "kvchat":
            self.set("fileTensorsValue", unknown)
            self.show_store(None)
        self.show_cache(facts["cache"]["positions"], "after loading" if not self.remote else "connected")

    def show_cache(self, positions: int, point: str, made_by=None, allocated=None, whose="in the cache") -> None:
        """The cache rows at `positions`, read against the facts of the model that made them (`made_by`, a
        reply's; else the model loaded now) and its allocation (`allocated`; not known: the loaded cache's,
        when that is the cache the reply was made in). The bar says `whose` figure it is (the selected reply's,
        or the cache's now), as the map's caption below it is always the cache now."""
        f = made_by or self.facts
        if not f:
            return
        if allocated is None and all(f.get(k) == self.facts.get(k) for k in SAME_CACHE):
            allocated = (self.facts.get("cache") or {}).get("allocated_bytes")
        per = f.get("kv_bytes_per_position")
        where = f" (from {f['kv_source']})" if f.get("kv_source") else ""
        self.set("kvPerPositionValue", NOT_REPORTED if per is None else fmt_bytes(per) + where)
        if positions is None:  # a remote server that reports no token counts
            set_bar(self.cacheBar, 1, 0, NOT_REPORTED)
            for name in ("cachePositionsValue", "kvPayloadValue", "kvFormulaValue"):
                self.set(name, NOT_REPORTED)
            self.set("cachePointValue", point)
            return
        cap = f.get("capacity")
        kinds = f.get("kv_layer_kinds")  # a sliding-window cache: a sliding layer's payload is min(positions, W)
        held = (
            [(k["layers"], positions if k["window"] is None else min(positions, k["window"])) for k in kinds]
            if kinds
            else [(f.get("layers"), positions)]
        )
        layers = sum(k["layers"] for k in kinds) if kinds else f.get("layers")  # those that keep K/V
        per_layer = None if per is None or not layers else per // layers
        state = f.get("state")  # a hybrid's convolution layers: a state the same at any length
        payload = None if per_layer is None else sum(n * t for n, t in held) * per_layer + (state or {}).get("bytes", 0)
        self.set("stateValue", state_words(state, positions))
        of = f"{positions:,} / {cap:,}" if cap else f"{positions:,} (capacity {NOT_REPORTED})"
        shown = f"{of} positions" if cap else f"{positions:,} positions"
        set_bar(self.cacheBar, cap or max(positions, 1), positions, f"{whose}: {shown}")
        self.set("cachePositionsValue", of)
        self.set("kvPayloadValue", NOT_REPORTED if payload is None else fmt_bytes(payload))
        self.set("kvAllocatedValue", NOT_REPORTED if allocated is None else fmt_bytes(allocated))
        known = per is not None and f.get("layers") is not None
        self.set("kvFormulaValue", kv_formula(f, held, kinds, positions, payload) if known else NOT_REPORTED)
        title, label = formula_title(f), self.formula_label()
        if label is not None and label.text() != title:
            label.setText(title)
            self.kvFormulaValue.setAccessibleName(title)
        self.set("cachePointValue", point)

    def formula_label(self):
        """The KV formula row's title label (the form's own, looked up now: the form may have made it anew)."""
        return self.cacheForm.labelForField(self.kvFormulaValue)

    def show_reply(self, s, title: str = "") -> None:
        """One reply's figures (a chat.ReplyStats), read against the engine and model that made it."""
        if self.heading.text() != (title or s.title):
            self.heading.setText(title or s.title)
        made = s.made_by or self.facts
        remote = made.get("backend") == "remote"
        self._timing_labels(remote)
        self.set("ttftValue", fmt_ms(s.figure("ttft_ms")))
        shown, ttft = s.on_screen_ms, s.figure("ttft_ms")
        seam = "" if ttft is None or shown is None or shown < ttft else f" · seam {shown - ttft:,.1f} ms"
        self.set("onScreenValue", DASH if shown is None else fmt_ms(shown) + seam)  # a seam is never negative
        if s.trace is not None:
            keys = ("ttft_queue_ms", "ttft_tokenize_ms", "ttft_vision_ms", "ttft_prefill_ms", "ttft_first_token_ms")
            parts = dict(zip(("queue", "template", "images", "prefill", "1st token"), (s.trace.get(k) for k in keys)))
            if s.trace.get("ttft_vision_ms") is None:  # no images: no encoder
                del parts["images"]
            if remote:  # here: waiting to send · the server's own TTFT · the rest (network, parsing)
                server = (s.trace.get("server") or {}).get("ttft_ms")
                queue, ttft = s.trace.get("ttft_queue_ms") or 0.0, s.trace.get("ttft_ms")
                rest = None if server is None or ttft is None else ttft - queue - server
                parts = {"send": queue, "server": server, "network": rest}
            self.set("ttftPartsValue", ttft_parts(parts, s.status in ("failed", "cancelled")))
            self.set("meanInclWaitValue", fmt_ms(s.trace.get("mean_ms_per_token_incl_wait")))
            self.set("imagesValue", image_words(s.trace.get("images"), made.get("kv_bytes_per_position")))
            self.set("prefillRateValue", fmt_rate(s.trace.get("prefill_tok_s"), "pos/s"))
        else:
            self.set("ttftPartsValue", DASH)
            self.set("meanInclWaitValue", DASH)
            self.set(
                "prefillRateValue",
                DASH if s.status != "prefill" else f"computing {s.prefill_done:,} / {s.prefill_total:,}",
            )
        self.set("tpotValue", fmt_ms(s.figure("tpot_ms")))
        self.set("tokensPerSecondValue", fmt_rate(s.figure("decode_tok_s")))
        self.set("e2eValue", fmt_ms(s.figure("e2e_ms")))
        self.set("tokensValue", s.tokens_words)
        self.show_confidence(s)
        for name, text in draft_rows((s.trace or {}).get("speculative"), s.steps, self.drafting).items():
            self.set(name, text)
        for name, text in grammar_rows((s.trace or {}).get("grammar"), s.steps, self.reply_format).items():
            self.set(name, text)
        if remote:
            self.set("serverTimingValue", server_timing(s.trace) if s.trace is not None else "after the reply")
        else:
            self.set("serverTimingValue", "same process")
        n = s.tokens
        point = (
            f"after prefill of {s.prompt_tokens:,} positions"
            if n == 0
            else f"after consuming token {n - 1} of {n} (token {n} not yet consumed)"
            if n > 1
            else "after prefill; token 1 selected, not yet consumed"
        )
        if s.reason == "eos":
            point = f"all {n} reply tokens consumed; the stop token was not"
        self.show_cache(s.cache_positions, point, s.made_by, s.allocated_bytes, whose="at this reply")
        r = s.reuse
        if r:
            first = r.get("first_invalidated_position")
            self.set("firstInvalidatedValue", DASH if first is None else f"{first:,}")
            ct, nt = r.get("cached_token"), r.get("new_token")
            same = not ct or not nt or ct.get("id") == nt.get("id")  # a token for itself is no change
            self.set(
                "tokenChangeValue", DASH if same else f"{ct['text']!r} (id {ct['id']}) → {nt['text']!r} (id {nt['id']})"
            )
            self.set("reuseSourceValue", reuse_source(r))
            unknown = r.get("source") == "unknown"
            self.set("reusedValue", NOT_REPORTED if unknown else f"{r['reused']:,}")
            self.set("recomputedValue", NOT_REPORTED if unknown else f"{r['computed']:,}")
            self.set("discardedValue", NOT_REPORTED if unknown else f"{r['invalidated']:,}")
            self.set("reuseReasonValue", r.get("reason") or "nothing invalidated")
            self.set("droppedValue", dropped_words(r))
        else:  # this reply has no reuse report (it failed before its prefill, or none was kept): none shown
            for name in REUSE_ROWS:
                self.set(name, DASH)
        gaps = s.gaps_ms
        self.gapChart.set_gaps(gaps)
        if gaps:
            self.gapStats.setText(
                f"p50 {percentile(gaps, 0.5):,.1f} ms · p95 {percentile(gaps, 0.95):,.1f} ms · {len(gaps)} gaps"
            )
        else:
            self.gapStats.setText(DASH)

    def show_cache_map(self, m, name=None) -> None:
        """The context map: the cache now, as the last request (or the one streaming) left it."""
        if self.cacheMap.show_map(m, name):
            self.refit.mark()

    def show_confidence(self, s) -> None:
        """The reply's mean log-probability, perplexity and low-confidence tokens, as its tokens come."""
        c = s.confidence
        if c["tokens"]:
            self.set("meanLogprobValue", f"{fmt_figure(c['mean_logprob'])} nats over {c['tokens']:,} tokens")
            self.set("perplexityValue", f"{c['perplexity']:,.2f}")
            share = c["low_confidence"] / c["tokens"]
            self.set("lowConfidenceValue", f"{c['low_confidence']:,} of {c['tokens']:,} ({share:.0%})")
            return
        gone = NOT_REPORTED_LOGPROBS if s.steps_reported is False else DASH
        for name in ("meanLogprobValue", "perplexityValue", "lowConfidenceValue"):
            self.set(name, gone)

    def show_store(self, store: dict | None) -> None:
        """The prefix store: bytes against the budget, prefixes, evictions, and its tree (the part the
        last request took from it in bold, the working cache's own positions in italics)."""
        if not store:
            if self.remote and self.facts.get("server_kind") != "kvchat":
                set_bar(self.storeBar, self.storeBar.maximum(), 0, NOT_REPORTED)
                for name in ("storeBytesValue", "storePrefixesValue", "storeEvictionsValue"):
                    self.set(name, NOT_REPORTED)
                self.storeTree.clear()
            return
        held, budget = store["bytes"], store["budget"]
        top = max(budget // 1024, 1)  # KiB: a QProgressBar counts in int
        set_bar(
            self.storeBar,
            top,
            min(held // 1024, top),
            f"{fmt_size(held)} of {fmt_size(budget)}" if budget else "off (budget 0)",
        )
        self.set("storeBytesValue", f"{fmt_bytes(held)} · {fmt_size(budget)}")
        self.set(
            "storePrefixesValue", f"{store['prefixes']:,} in {store['nodes']:,} blocks of {store['block']} positions"
        )
        self.set("storeEvictionsValue", f"{store['evictions']:,} blocks ({store['evicted_positions']:,} positions)")
        self.set("diskValue", f"off: {store['disk_off']}" if store.get("disk_off") else disk_words(store.get("disk")))
        self.storeTree.setToolTip(plain_tooltip(store.get("dropped") or PICTURE_HELP["storeTree"]))
        per = self.facts.get("kv_bytes_per_position", 0)
        self.storeTree.clear()

        for seg in store.get("tree", []):
            add_store_segment(self.storeTree, seg, per)
        self.storeTree.expandAll()

    def show_conversation_cached(self, seen: dict | None) -> None:
        """How much of the conversation on screen is cached, asked when it was opened."""
        self.set("conversationCachedValue", cached_words(seen))

    def show_summary(self, summary: dict) -> None:
        self.set("requestsValue", str(summary["requests"]))
        self.set("failedValue", f"{summary['failed']} · {summary['cancelled']}")
        self.set("medianTtftValue", fmt_ms(summary["median_ttft_ms"]))
        self.set("medianTpotValue", fmt_ms(summary["median_tpot_ms"]))
