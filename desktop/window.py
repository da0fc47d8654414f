"""The main window: conversations, transcript and composer, the inference panel; and the chat logic.

Replies are consumed as an async stream of engine events on the qasync loop. Widgets are
refreshed by a timer (at most ~7 updates a second, fewer when redraws cost too much) from plain
state, never per token.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (QFileDialog, QHBoxLayout, QInputDialog, QLabel, QLineEdit, QListWidget,
                               QListWidgetItem, QMainWindow, QMessageBox, QPlainTextEdit, QProgressBar, QPushButton,
                               QSplitter, QVBoxLayout, QWidget)

from engine.sampling import SamplingParams
from engine.session import Request
from engine.trace import now

from .client import EngineClient
from .panel import ReplyStats, StatsPanel
from .settings import Settings, SettingsDialog, open_settings
from .store import Store, StoreError
from .transcript import MessageView, Transcript
from .worker import WorkerThread

REFRESH_MS = 150  # the fastest the streaming text redraws (~7 times a second; at 10 the engine kept
# 2-3 points less of its rate in paired seam runs)
SLOWEST_REFRESH_MS = 400
GUI_CPU_BUDGET = 0.02  # share of one core the GUI thread may take while a reply streams
PANEL_EVERY_S = 0.5  # the panel's figures twice a second while a reply streams (and once at its end)
# The GUI thread's CPU time costs the engine about as much wall time, whatever the core count: a
# burst of painting preempts one of the engine's OpenMP threads (or the one spinning between its
# parallel regions), and the others wait for it at the region's end. So the redraw interval adapts
# to keep the GUI thread within 2% of a core while tokens stream (python -m desktop.seam_bench).
SAVE_EVERY_S = 0.25  # partial replies reach the database this often while streaming


class Composer(QPlainTextEdit):
    """Enter sends; Shift+Enter is a new line."""
    submitted = Signal()

    def keyPressEvent(self, e):
        if e.key() in (Qt.Key_Return, Qt.Key_Enter) and not (e.modifiers() & Qt.ShiftModifier):
            self.submitted.emit()
            return
        super().keyPressEvent(e)


class MainWindow(QMainWindow):
    replyFinished = Signal(dict)  # the final event of each reply (tests and tools wait on it)
    modelReady = Signal(dict)

    def __init__(self, data_directory: Path, worker_thread: WorkerThread | None = None):
        super().__init__()
        self.setWindowTitle("kvchat")
        self.resize(1380, 860)
        self.data_directory = Path(data_directory)
        self.qsettings = open_settings(self.data_directory)
        self.settings = Settings.load(self.qsettings)
        self.db_path = self.data_directory / "kvchat.db"
        self.loop = asyncio.get_event_loop()
        self.worker_thread = worker_thread or WorkerThread()
        self.worker = self.worker_thread.worker
        self.client = EngineClient(self.worker)
        self.facts: dict | None = None
        self.current_cid: int | None = None
        self.generating = False
        self.stats = ReplyStats()
        self.stats_by_message: dict[int, ReplyStats] = {}
        self.selected_mid: int | None = None
        self.streaming_mid: int | None = None
        self._dirty = False
        self._deleted: list[int] = []
        self._task: asyncio.Task | None = None
        self._closing = False
        self._stream_text = ""
        self._panel_at = 0.0
        self._edit_highlight = None
        self._build()
        self._open_store()
        self.worker.modelLoading.connect(self._on_model_loading)
        self.worker.modelLoaded.connect(self._on_model_loaded)
        self.worker.modelFailed.connect(self._on_model_failed)
        self.worker.compared.connect(self._on_compared)
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self._refresh)
        self._cpu_mark = (now(), time.thread_time())
        self.load_model()

    # --- layout ------------------------------------------------------------------------
    def _build(self) -> None:
        left = QWidget()
        ll = QVBoxLayout(left)
        self.search = QLineEdit()
        self.search.setObjectName("conversationSearch")
        self.search.setPlaceholderText("Search conversations")
        self.search.textChanged.connect(self._fill_conversations)
        ll.addWidget(self.search)
        self.conversationList = QListWidget()
        self.conversationList.setObjectName("conversationList")
        self.conversationList.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.conversationList.setTextElideMode(Qt.ElideRight)
        self.conversationList.currentItemChanged.connect(self._on_conversation_picked)
        ll.addWidget(self.conversationList)
        row = QHBoxLayout()
        self.newButton = _button("New", "newButton", self.new_conversation, row)
        self.renameButton = _button("Rename", "renameButton", self.rename_conversation, row)
        self.deleteButton = _button("Delete", "deleteButton", self.delete_conversation, row)
        ll.addLayout(row)
        self.undoButton = _button("Undo delete", "undoDeleteButton", self.undo_delete, ll)
        self.undoButton.setVisible(False)

        center = QWidget()
        cl = QVBoxLayout(center)
        self.banner = QLabel()
        self.banner.setObjectName("errorBanner")
        self.banner.setWordWrap(True)
        self.banner.setVisible(False)
        cl.addWidget(self.banner)
        self.transcript = Transcript()
        cl.addWidget(self.transcript, 1)
        actions = QHBoxLayout()
        self.regenerateButton = _button("Regenerate", "regenerateButton", self.regenerate, actions)
        self.continueButton = _button("Continue", "continueButton", self.continue_reply, actions)
        actions.addStretch(1)
        cl.addLayout(actions)
        comp = QHBoxLayout()
        self.composer = Composer()
        self.composer.setObjectName("composer")
        self.composer.setPlaceholderText("Message the model (Enter sends, Shift+Enter for a new line)")
        self.composer.setMaximumHeight(110)
        self.composer.submitted.connect(self.send)
        comp.addWidget(self.composer, 1)
        self.sendButton = _button("Send", "sendButton", self.send, comp)
        self.stopButton = _button("Stop", "stopButton", self.stop, comp)
        self.stopButton.setVisible(False)
        cl.addLayout(comp)

        self.statsPanel = StatsPanel()
        self.statsPanel.exportRequested.connect(self.export_trace)
        split = QSplitter()
        split.addWidget(left)
        split.addWidget(center)
        split.addWidget(self.statsPanel)
        split.setSizes([230, 760, 390])
        split.setStretchFactor(1, 1)
        self.setCentralWidget(split)

        self.loadProgress = QProgressBar()
        self.loadProgress.setObjectName("loadProgress")
        self.loadProgress.setRange(0, 0)
        self.loadProgress.setMaximumWidth(160)
        self.loadProgress.setVisible(False)
        self.statusBar().addPermanentWidget(self.loadProgress)
        menu = self.menuBar().addMenu("&kvchat")
        for text, slot, key in (("Settings…", self.open_settings_dialog, "Ctrl+,"),
                                ("About", self.show_about, None), ("Quit", self.close, "Ctrl+Q")):
            act = QAction(text, self)
            act.triggered.connect(slot)
            if key:
                act.setShortcut(QKeySequence(key))
            menu.addAction(act)
        self._update_buttons()

    # --- store -------------------------------------------------------------------------
    def _open_store(self) -> None:
        try:
            self.store = Store(self.db_path)
        except StoreError as e:
            self.show_error(str(e))
            self.store = Store(":memory:")  # usable, but nothing is saved until the database is free again
            return
        if self.store.moved_aside is not None:
            self.show_error(f"The conversation database could not be read, so it was moved aside to "
                            f"{self.store.moved_aside} (nothing was overwritten) and a new one was started.")
        self._fill_conversations()
        convs = self.store.conversations()
        if convs:
            self.select_conversation(convs[0].id)

    def _guard(self, fn, *args, **kw):
        """Run a store call; a locked or failing database becomes a message, not a crash."""
        try:
            return fn(*args, **kw)
        except StoreError as e:
            self.show_error(str(e))
            return None

    def _fill_conversations(self, *_):
        self.conversationList.blockSignals(True)
        self.conversationList.clear()
        for c in self.store.conversations(self.search.text()):
            item = QListWidgetItem(c.title)
            item.setData(Qt.UserRole, c.id)
            self.conversationList.addItem(item)
            if c.id == self.current_cid:
                self.conversationList.setCurrentItem(item)
        self.conversationList.blockSignals(False)

    def _on_conversation_picked(self, item, _prev=None):
        if item is not None and not self.generating:
            self.select_conversation(item.data(Qt.UserRole))

    def select_conversation(self, cid: int | None) -> None:
        self.current_cid = cid
        self._fill_conversations()
        self.render_transcript()

    def new_conversation(self) -> None:
        if self.generating:
            return
        conv = self._guard(self.store.new_conversation)
        if conv:
            self.select_conversation(conv.id)
            self.composer.setFocus()

    def rename_conversation(self) -> None:
        if self.current_cid is None:
            return
        title, ok = QInputDialog.getText(self, "Rename", "Title:", text=self.store.conversation(self.current_cid).title)
        if ok and title.strip():
            self._guard(self.store.rename, self.current_cid, title.strip())
            self._fill_conversations()

    def delete_conversation(self) -> None:
        if self.current_cid is None or self.generating:
            return
        self._guard(self.store.delete, self.current_cid)
        self._deleted.append(self.current_cid)
        self.undoButton.setVisible(True)
        self.statusBar().showMessage("Conversation deleted. Undo brings it back.", 8000)
        convs = self.store.conversations()
        self.select_conversation(convs[0].id if convs else None)

    def undo_delete(self) -> None:
        if self._deleted:
            cid = self._deleted.pop()
            self._guard(self.store.undelete, cid)
            self.select_conversation(cid)
        self.undoButton.setVisible(bool(self._deleted))

    # --- transcript --------------------------------------------------------------------
    def render_transcript(self) -> None:
        """Show the current branch. Views that still show the same message at the same branch position
        are kept (their text updated if it changed), so sending, finishing or editing lays out only
        the messages that changed, not a long conversation from the top."""
        rows = []
        for m in self.store.branch(self.current_cid) if self.current_cid is not None else []:
            sibs = self.store.siblings(m)
            rows.append((m, next(i for i, s in enumerate(sibs) if s.id == m.id), len(sibs)))
        views = self.transcript.views
        keep = 0
        while keep < min(len(views), len(rows)) and views[keep].can_show(*rows[keep]):
            views[keep].show_message(rows[keep][0])
            keep += 1
        self.transcript.truncate(keep)
        for m, idx, count in rows[keep:]:
            view = MessageView(m, idx, count)
            view.editSubmitted.connect(self.edit_message)
            view.branchRequested.connect(self.switch_branch)
            view.selected.connect(self.select_message)
            view.compareRequested.connect(self.compare_reply)
            self.transcript.add(view)
        for view in self.transcript.views:
            view.editButton.setEnabled(not self.generating)
        self._update_buttons()

    def select_message(self, mid: int) -> None:
        self.selected_mid = mid
        st = self.stats_by_message.get(mid)
        if st is None:
            m = self.store.message(mid)
            if m.trace:
                st = ReplyStats(trace=m.trace.get("trace"), reuse=m.trace.get("reuse"),
                                cache_positions=(m.trace.get("cache") or {}).get("positions", 0),
                                prompt_tokens=(m.trace.get("trace") or {}).get("prompt_tokens", 0),
                                status=m.trace.get("status", m.status), reason=m.trace.get("reason"))
                self.stats_by_message[mid] = st
        if st is not None:
            self.stats = st
            self._mark_dirty()

    def switch_branch(self, mid: int, delta: int) -> None:
        if self.generating:
            return
        m = self.store.message(mid)
        sibs = self.store.siblings(m)
        i = next(k for k, s in enumerate(sibs) if s.id == mid) + delta
        if 0 <= i < len(sibs):
            self._guard(self.store.set_leaf, self.current_cid, self.store.deepest_leaf(sibs[i].id))
            self.render_transcript()

    # --- model -------------------------------------------------------------------------
    def load_model(self) -> None:
        self.worker.load(**self.settings.model_args())

    def _on_model_loading(self, what: str) -> None:
        self.loadProgress.setVisible(True)
        self.statusBar().showMessage(f"Loading {what}…")
        self._update_buttons()

    def _on_model_loaded(self, facts: dict) -> None:
        self.facts = facts
        self.loadProgress.setVisible(False)
        self.statsPanel.show_model(facts)
        note = f"Model {facts['name']} ready on {facts['device']} ({facts['dtype']})."
        if facts.get("cache_dropped"):
            note += f" {facts['cache_dropped']}."
            self.statsPanel.set("reuseReasonValue", facts["cache_dropped"])
        self.statusBar().showMessage(note, 10000)
        self._update_buttons()
        self.modelReady.emit(facts)

    def _on_model_failed(self, error: str) -> None:
        self.loadProgress.setVisible(False)
        keep = " The previous model is still in use." if self.facts else ""
        self.show_error(f"The model could not be loaded: {error}.{keep}")
        self._update_buttons()
        self.modelReady.emit({"error": error})

    def open_settings_dialog(self) -> None:
        dlg = SettingsDialog(self.settings, self.db_path, self)
        if dlg.exec():
            self.apply_settings(dlg.result_settings())

    def apply_settings(self, new: Settings) -> None:
        reload = any(getattr(new, k) != getattr(self.settings, k) for k in Settings.MODEL_KEYS)
        self.settings = new
        new.save(self.qsettings)
        if reload:
            self.load_model()

    def show_about(self) -> None:
        QMessageBox.about(self, "About kvchat",
                          f"<b>kvchat</b> — a local chat that shows inference as it happens.<br><br>"
                          f"Conversations: {self.db_path}<br>Settings: {self.data_directory / 'settings.ini'}")

    def show_error(self, text: str) -> None:
        self.banner.setText(text)
        self.banner.setVisible(True)
        self.statusBar().showMessage(text, 15000)

    # --- chatting ----------------------------------------------------------------------
    def _update_buttons(self) -> None:
        ready = self.facts is not None and not self.loadProgress.isVisible()
        self.sendButton.setVisible(not self.generating)
        self.stopButton.setVisible(self.generating)
        self.sendButton.setEnabled(ready)
        last = self.transcript.views[-1].message if self.transcript.views else None
        self.regenerateButton.setEnabled(ready and not self.generating and last is not None
                                         and last.role == "assistant")
        self.continueButton.setEnabled(ready and not self.generating and last is not None
                                       and last.role == "assistant" and last.status in ("length", "stopped",
                                                                                        "incomplete"))

    def _messages(self, upto: list) -> list[dict]:
        sys_prompt = [{"role": "system", "content": self.settings.system_prompt}] if self.settings.system_prompt else []
        return sys_prompt + [{"role": m.role, "content": m.content} for m in upto]

    def _request(self, messages, arrival, **kw) -> Request:
        s = self.settings
        sampling = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                                  repetition_penalty=s.repetition_penalty, seed=None if s.seed < 0 else s.seed)
        return Request(messages=messages, sampling=sampling, max_new_tokens=s.max_new_tokens, arrival=arrival, **kw)

    def send(self) -> None:
        text = self.composer.toPlainText().strip()
        if not text or self.generating or self.facts is None:
            return
        arrival = now()  # the moment Send was pressed: TTFT counts from here
        if self.current_cid is None:
            conv = self._guard(self.store.new_conversation, text[:48] + ("…" if len(text) > 48 else ""))
            if conv is None:
                return
            self.current_cid = conv.id
            self._fill_conversations()
        else:
            conv = self.store.conversation(self.current_cid)
            if conv.title == "New chat":
                self._guard(self.store.rename, conv.id, text[:48] + ("…" if len(text) > 48 else ""))
                self._fill_conversations()
        user = self._guard(self.store.add_message, self.current_cid, conv.leaf_id, "user", text)
        if user is None:
            return
        self.composer.clear()
        self.start_reply(user.id, arrival)

    def edit_message(self, mid: int, text: str) -> None:
        """An edit makes a sibling branch; a user edit regenerates the reply through prefix reuse."""
        if self.generating:
            return
        arrival = now()
        old = self.store.message(mid)
        new = self._guard(self.store.add_message, self.current_cid, old.parent_id, old.role, text)
        if new is None:
            return
        self._edit_highlight = (new.id, _first_difference(old.content, text))
        if old.role == "user":
            self.start_reply(new.id, arrival)
        else:
            self.render_transcript()

    def regenerate(self) -> None:
        views = self.transcript.views
        if self.generating or not views or views[-1].message.role != "assistant":
            return
        self.start_reply(views[-1].message.parent_id, now())

    def continue_reply(self) -> None:
        views = self.transcript.views
        if self.generating or not views or views[-1].message.role != "assistant":
            return
        self.start_reply(views[-1].message.parent_id, now(), continue_mid=views[-1].message.id)

    def compare_reply(self, mid: int) -> None:
        """Rerun the prompt of this reply at the other precision (in the worker) and show both."""
        if self.generating or self.facts is None:
            return
        m = self.store.message(mid)
        path = self.store.branch(self.current_cid)
        upto = path[:next(i for i, x in enumerate(path) if x.id == m.parent_id) + 1]
        self._compare_rid = getattr(self, "_compare_rid", 0) + 1
        self.statusBar().showMessage("Comparing with the other precision…")
        self.worker.compare(self._compare_rid, self._messages(upto), self.settings.max_new_tokens)

    def _on_compared(self, rid: int, result: dict) -> None:
        from .compare import CompareDialog
        self.statusBar().clearMessage()
        self.last_comparison = result
        self.compareDialog = CompareDialog(result, self)
        self.compareDialog.show()

    def stop(self) -> None:
        self.client.stop()

    def start_reply(self, parent_id: int, arrival: float, continue_mid: int | None = None) -> None:
        self._task = self.loop.create_task(self._reply(parent_id, arrival, continue_mid))
        self._task.add_done_callback(self._reply_done)

    def _reply_done(self, task: asyncio.Task) -> None:
        """A bug in the reply code must not leave the window stuck in 'generating'."""
        if task.cancelled() or task.exception() is None:
            return
        self.generating = False
        self.streaming_mid = None
        self.show_error(f"Internal error while replying: {task.exception()!r}")
        self._update_buttons()

    async def _reply(self, parent_id: int, arrival: float, continue_mid: int | None) -> None:
        self.generating = True
        self.banner.setVisible(False)
        path = self.store.branch(self.current_cid)
        upto = path[:next(i for i, m in enumerate(path) if m.id == parent_id) + 1]
        if continue_mid is not None:
            base = self.store.message(continue_mid)
            prefix, old_tokens = base.content, base.token_count or 0
            assistant = self.store.add_message(self.current_cid, parent_id, "assistant", prefix, status="streaming")
            req = self._request(self._messages(upto) + [{"role": "assistant", "content": prefix}], arrival,
                                continue_final_message=True, add_generation_prompt=False)
        else:
            prefix, old_tokens = "", 0
            assistant = self.store.add_message(self.current_cid, parent_id, "assistant", "", status="streaming")
            req = self._request(self._messages(upto), arrival)
        self.streaming_mid = assistant.id
        self.render_transcript()
        highlight, self._edit_highlight = self._edit_highlight, None
        self.stats = ReplyStats(arrival=arrival, status="prefill")
        self.stats_by_message[assistant.id] = self.stats
        self.selected_mid = assistant.id
        text, last_save, final = prefix, now(), None
        self._stream_text = text
        uncounted = {m.id for m in upto if m.token_count is None}
        async for batch in self.client.stream(req):
            for ev in batch:
                text, final = self._apply_event(ev, text, final)
                if "message_tokens" in ev:
                    n_sys = 1 if self.settings.system_prompt else 0
                    counts = ev["message_tokens"][n_sys:n_sys + len(upto)]
                    for m, n in zip(upto, counts):
                        if m.id in uncounted:
                            self._guard(self.store.update_message, m.id, token_count=n)
            self._stream_text = text
            if final is None and now() - last_save >= SAVE_EVERY_S:
                self._guard(self.store.update_message, assistant.id, content=text,
                            token_count=old_tokens + self.stats.tokens)
                last_save = now()
            self._mark_dirty()
        status = {"eos": "complete", "stop_string": "complete", "max_new_tokens": "length", "capacity": "length",
                  "cancelled": "stopped"}.get(final.get("reason"), "failed")
        if final["type"] == "finished":
            text = prefix + final["text"]
        record = {"status": status, "reason": final.get("reason"), "trace": final.get("trace"),
                  "reuse": final.get("reuse"), "cache": final.get("cache"), "error": final.get("error")}
        self._guard(self.store.update_message, assistant.id, content=text, status=status,
                    token_count=old_tokens + self.stats.tokens, trace=record)
        if final["type"] == "failed":
            self.show_error(f"The reply failed: {final['error']}")
        if final.get("summary"):
            self.statsPanel.show_summary(final["summary"])
        self.generating = False
        self.streaming_mid = None
        self.render_transcript()
        if highlight and self.stats.reuse and self.stats.reuse.get("first_invalidated_position") is not None:
            view = self.transcript.view_for(highlight[0])
            if view is not None:
                a = highlight[1]
                width = len((self.stats.reuse.get("new_token") or {}).get("text", "").strip()) or 1
                view.set_highlight(a, a + width)
        self._mark_dirty()
        self._refresh()
        self.replyFinished.emit(final)

    def _apply_event(self, ev: dict, text: str, final):
        s = self.stats
        kind = ev["type"]
        if kind == "prefill_started":
            s.reuse, s.prompt_tokens, s.prefill_total = ev["reuse"], ev["prompt_tokens"], ev["reuse"]["computed"]
        elif kind == "prefill_progress":
            s.prefill_done, s.cache_positions = ev["done"], ev["cache_positions"]
        elif kind == "prefill_done":
            s.status, s.cache_positions, s.prefill_done = "decoding", ev["cache_positions"], ev["computed"]
        elif kind == "token":
            s.token_times.append(ev["time"])
            s.cache_positions = ev["cache_positions"]
            text += ev["text"]
        elif kind == "finished":
            s.trace, s.reuse, s.reason = ev["trace"], ev["reuse"], ev["reason"]
            s.cache_positions = ev["cache"]["positions"]
            s.status = "cancelled" if ev["reason"] == "cancelled" else "finished"
            text += ev.get("tail", "")
            final = ev
        elif kind == "failed":
            s.status, s.error, final = "failed", ev["error"], ev
            if ev.get("cache"):
                s.cache_positions = ev["cache"]["positions"]
        return text, final

    def _adapt_refresh(self) -> None:
        """Stretch the redraw interval while the GUI thread uses more than its CPU budget, shrink it back
        when it uses less (measured with the thread's own CPU clock, paint time included)."""
        wall, cpu = now(), time.thread_time()
        span = wall - self._cpu_mark[0]
        if span < 0.5:
            return
        busy = (cpu - self._cpu_mark[1]) / span
        self._cpu_mark = (wall, cpu)
        interval = self.timer.interval()
        if not self.generating:
            interval = REFRESH_MS
        elif busy > GUI_CPU_BUDGET:
            interval = min(SLOWEST_REFRESH_MS, int(interval * 1.5))
        elif busy < GUI_CPU_BUDGET / 2:
            interval = max(REFRESH_MS, int(interval / 1.5))
        if interval != self.timer.interval():
            self.timer.setInterval(interval)

    def _mark_dirty(self) -> None:
        """Something the redraw shows changed: redraw at the next tick (the timer runs only while there
        is something to redraw: an idle timer costs the GUI thread ~1% of a core under qasync)."""
        self._dirty = True
        if not self.timer.isActive() and not self._closing:
            self.timer.start()

    def _refresh(self) -> None:
        """The throttled redraw: the streaming message's text and the panel, at most every timer tick."""
        self._adapt_refresh()
        if not self._dirty:
            if not self.generating:
                self.timer.stop()
            return
        self._dirty = False
        if self.streaming_mid is not None:
            view = self.transcript.view_for(self.streaming_mid)
            if view is not None:
                view.set_content(self._stream_text, "streaming", self.stats.tokens)
        title = {"finished": f"Reply · {self.stats.reason}", "cancelled": "Reply · stopped",
                 "failed": f"Reply · failed: {self.stats.error}"}.get(self.stats.status, "")
        if self.generating and now() - self._panel_at < PANEL_EVERY_S:
            return
        self._panel_at = now()
        self.statsPanel.show_reply(self.stats, title)
        self._update_buttons()

    def export_trace(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export trace", "kvchat-trace.json", "JSON (*.json)")
        if path:
            self.write_trace(Path(path))

    def write_trace(self, path: Path) -> None:
        record = {"message_id": self.selected_mid, **self.stats.to_json(), "model": self.facts}
        path.write_text(json.dumps(record, indent=2, ensure_ascii=False))

    # --- closing -----------------------------------------------------------------------
    def closeEvent(self, e) -> None:
        """Stop a generation, wait for the worker, save the partial reply, then close."""
        if self._closing:
            e.accept()
            return
        self._closing = True
        self.timer.stop()
        if self.generating and self.streaming_mid is not None:
            self.client.stop()
            self._guard(self.store.update_message, self.streaming_mid, content=self._stream_text, status="stopped",
                        token_count=self.stats.tokens)
        self.worker_thread.close()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self.store.close()
        e.accept()


def _button(text: str, name: str, slot, layout) -> QPushButton:
    """A push button with its object name (what tests and the style sheet find it by), wired and placed."""
    b = QPushButton(text)
    b.setObjectName(name)
    b.clicked.connect(slot)
    layout.addWidget(b)
    return b


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
