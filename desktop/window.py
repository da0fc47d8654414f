"""The main window: conversations, transcript and composer, the inference panel.

It shows what the chat controller (chat.py) holds and forwards what the person does to it. While
a reply streams, a timer redraws the growing text and the panel from that state, never per token,
and adapts its interval so the GUI thread stays within a small CPU budget (pacing.py; desktop/README.md,
"The seam"). Its widgets are built in window_layout.py, its side of the engine and the settings is
window_models.py; the conversations' list is sidebar.py, the branch drawn into the transcript branch_view.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QInputDialog,
    QMainWindow,
)

from engine.trace import now

from .client import EngineClient
from .context_meter import refusal
from .core.chat import ChatController
from .core.replies import transcript_marks
from .core.settings import Settings
from .core.store import Store
from .core.store_file import StoreError
from .keyboard import Keyboard
from .outside_text import warn
from .settings_dialog import open_settings
from .token_view import MODES as TOKEN_MODES
from .transcript import MessageView
from .window_images import WindowImages
from .window_layout import WindowLayout
from .window_models import ModelSide

PANEL_EVERY_S = 0.5  # the panel's figures twice a second while a reply streams (and once at its end)


class MainWindow(ModelSide, WindowImages, WindowLayout, Keyboard, QMainWindow):
    replyFinished = Signal(object)  # the last event of each reply, Finished or Failed (tests and tools wait on it)
    modelReady = Signal(dict)
    conversationProbed = Signal(dict)  # how much of the conversation on screen is cached (tests wait on it)

    def __init__(self, data_directory: Path, client: EngineClient | None = None, model: str | None = None):
        """`model`: a model folder or GGUF file to start on (`kvchat --model PATH`), instead of the settings'."""
        super().__init__()
        self.setWindowTitle("kvchat")
        self.resize(1380, 860)
        self.data_directory = Path(data_directory)
        self.qsettings = open_settings(self.data_directory)
        self.settings = Settings.load(self.qsettings)
        if model is not None:
            self.settings.model = dataclasses.replace(self.settings.model, path=str(Path(model).expanduser()))
        self.db_path = self.data_directory / "kvchat.db"
        self.loop = asyncio.get_event_loop()
        self.client = client or EngineClient()
        self.facts: dict | None = None
        self._deleted: list[int] = []
        self._task: asyncio.Task | None = None  # the reply started last
        self._tasks: set[asyncio.Task] = set()  # every reply running (one a conversation, or its alternatives)
        self._closing = False
        self._regenerate_on_load = False  # Regenerate with…: the reply is made again once the model has loaded
        self._marks: dict[int, dict] = {}  # the transcript's notes by message id (mark_transcript)
        self.worker_left_running = False  # closed while the worker was inside a call it cannot leave
        self.importing = None  # the import running on its own thread (export_import.py)
        self._panel_at = 0.0
        self._asked = 0  # the probes asked (the meter's reading says which it answers)
        self._send_when_probed: float | None = None  # a Send waiting for the reading of its draft
        self._build()
        self.apply_theme()
        self.show_models()
        self.chat = ChatController(self._open_store(), self.client, self.settings, self, now)
        self.approval = None  # the tool call's question shown last (tool_approval)
        self.set_tool_servers(self.settings)
        self._show_first_conversation()
        self.composer.setFocus()  # where a person types first, after a restart too
        self._update_buttons()
        self.client.modelLoading.connect(self._on_model_loading)
        self.client.modelLoadProgress.connect(self._on_load_progress)
        self.client.modelLoaded.connect(self._on_model_loaded)
        self.client.modelFailed.connect(self._on_model_failed)
        self.client.compared.connect(self._on_compared)
        self.client.probed.connect(self._on_probed)
        self.load_model()

    @property
    def store(self) -> Store:
        return self.chat.store

    @property
    def stats(self):
        return self.chat.stats

    @property
    def generating(self) -> bool:
        return self.chat.generating

    # --- store and conversations --------------------------------------------------------
    def _open_store(self) -> Store:
        try:
            store = Store(self.db_path)
        except StoreError as e:  # locked by another program
            self.show_error(f"{e}. kvchat runs on a temporary database: what you send now is not saved.")
            store = Store(":memory:")
        if store.notice:
            self.show_error(store.notice)
        store.on_held = self.heldBanner.held
        return store

    def _show_first_conversation(self) -> None:
        convs = self.store.conversations()
        self.select_conversation(convs[0].id if convs else None)

    def _fill_conversations(self, *_):
        search = self.search.text()
        if not search.strip():
            for v in self.transcript.views:
                v.set_found(False)
        self.sidebar.fill(self.store.conversations(search), self.store.search_hits(search), self.chat.current_cid)

    def _on_conversation_picked(self, cid: int, found: int | None) -> None:
        """Open another conversation, also while a reply streams (it goes on into its own); a search
        result opens at the message that matched."""
        if cid != self.chat.current_cid:
            self.select_conversation(cid, refill=False)  # the list is not re-sorted under the pointer or the keys
        if found is not None:
            self.show_found(found)

    def show_found(self, mid: int) -> None:
        """Bring a message (a search's match) into view: its branch shown, the message marked, scrolled
        to and focused (Ctrl+Up/Down go on from there)."""
        self.branch.whole_branch()
        if self.chat.reveal(mid):
            self.render_transcript()
            self.probe_conversation()
        at = next((i for i, (m, _, _) in enumerate(self.branch.rows) if m.id == mid), None)  # the branch as drawn
        if at is not None and at < self.transcript.first:
            self.render_transcript(reveal=at)
        for v in self.transcript.views:
            v.set_found(v.message.id == mid)
        if not self.generating:
            self.select_message(mid)  # a reply: the panel shows its figures
        view = self.transcript.view_for(mid)
        if view is not None:
            view.setFocus(Qt.OtherFocusReason)
            QTimer.singleShot(  # once laid out; not if the transcript was redrawn without it meanwhile
                0, lambda: view in self.transcript.views and self.transcript.ensureWidgetVisible(view, 0, 40)
            )

    def select_conversation(self, cid: int | None, refill: bool = True) -> None:
        """Show conversation `cid`; `refill`: the list drawn again (new titles, a new order) with it current."""
        self.chat.current_cid = cid
        self.regenerateHint.setVisible(False)  # it was about the reply regenerated in the one left
        if refill:
            self._fill_conversations()
        self.render_transcript()
        self.show_conversation_settings()
        self.probe_conversation()
        self._update_buttons()  # Send or Stop: this conversation's own reply, whatever streams in another

    def probe_conversation(self) -> None:
        """Ask the engine how much of the conversation on screen is still cached (shown before anything
        is sent; the answer arrives as `probed`) once the window has drawn it: the engine renders and
        tokenizes the whole conversation, Python work that holds the GIL the GUI thread's drawing needs."""
        self.probeTimer.start()

    def _probe_now(self) -> None:
        if self._closing:
            return
        cid = self.chat.current_cid
        if self.branch.reading is not None and self.branch.reading == cid:  # asked again once the branch is read
            self.probeTimer.start()
            return
        path = self.chat.branch()
        if self.facts is None:
            self.statsPanel.show_conversation_cached(None)
            return
        s = self.chat.settings_for(cid)
        self._asked += 1
        messages = self.chat.messages(path, cid)
        tools = self.chat.tool_fields(cid, messages).get("tools", ())
        self.client.probe(
            -1 if cid is None else cid, messages, self.composer.toPlainText().strip(),
            s.max_new_tokens, s.policy, self._asked, tools, self.draft_images,
        )  # as Send sends it  # fmt: skip

    def _on_probed(self, cid: int, seen: dict) -> None:
        if self._closing or cid != (-1 if self.chat.current_cid is None else self.chat.current_cid):
            return
        self.seen = seen
        self.statsPanel.show_conversation_cached(seen if self.chat.branch() else None)
        self.show_meter()
        self.conversationProbed.emit(seen)
        if self._send_when_probed is not None and self._reading_is_current():
            arrival, self._send_when_probed = self._send_when_probed, None
            self._send(arrival)

    def _reading_is_current(self) -> bool:
        """Whether the meter's reading answers the last question asked (the draft and the conversation on
        screen now: a change since starts the probe's timer again)."""
        return (self.seen or {}).get("asked") == self._asked and not self.probeTimer.isActive()

    def show_meter(self) -> None:
        """The positions the next Send would need against the capacity (context_meter.py)."""
        if self._closing:
            return
        capacity = (self.facts or {}).get("capacity")
        self.contextMeter.show_reading(self.seen, capacity, self.chat.settings_for().max_new_tokens)

    def new_conversation(self) -> None:
        if self.chat.new_conversation():
            self.select_conversation(self.chat.current_cid)
            self.composer.setFocus()

    def rename_conversation(self) -> None:
        cid = self.chat.current_cid
        if cid is None:
            return
        title, ok = QInputDialog.getText(self, "Rename", "Title:", text=self.store.conversation(cid).title)
        if ok and title.strip():
            self.chat.guard(self.store.rename, cid, title.strip())
            self._fill_conversations()

    def delete_conversation(self) -> None:
        cid = self.chat.current_cid
        if cid is None or self.generating:
            return
        self.chat.guard(self.store.delete, cid)
        self._deleted.append(cid)
        self.undoButton.setVisible(True)
        self.statusBar().showMessage("Conversation deleted. Undo brings it back.", 8000)
        self._show_first_conversation()

    def undo_delete(self) -> None:
        if self._deleted:
            cid = self._deleted.pop()
            self.chat.guard(self.store.undelete, cid)
            self.select_conversation(cid)
        self.undoButton.setVisible(bool(self._deleted))

    # --- transcript --------------------------------------------------------------------
    def render_transcript(self, reveal: int | None = None) -> None:
        """Show the current branch (branch_view.BranchView; `reveal`: from this branch index at least), and
        the panel the figures of its last reply (another conversation's or branch's never stay)."""
        self.branch.render(reveal)
        self.mark_transcript()
        last = next((v.message.id for v in reversed(self.transcript.views) if v.message.role == "assistant"), None)
        if self.chat.follow_shown(last):
            self.pacer.mark_dirty()

    def mark_transcript(self) -> None:
        """What the transcript says beside messages, from the branch's stored replies: the model that made each
        reply, a line where the model changed between replies, and the messages the last reply did not see
        (its overflow policy left them out). Views drawn later (the backfill) are marked as they are made."""
        path = [row[0] for row in self.branch.rows] or [v.message for v in self.transcript.views]
        marks = transcript_marks(path)
        self._marks = marks
        for v in self.transcript.views:
            self._mark(v)

    def _mark(self, view: MessageView) -> None:
        mark = self._marks.get(view.message.id, {})
        view.set_left_out(mark.get("left_out", ""))
        view.set_model(mark.get("model"), mark.get("changed", ""))

    def _fit_view(self, view: MessageView) -> None:
        """A message view's buttons as the window's state allows: no edits while a reply runs, no Compare
        on a remote engine (it needs local weights)."""
        view.editButton.setEnabled(not self.generating)
        remote = (self.facts or {}).get("backend") == "remote"
        view.compareButton.setVisible(view.message.role == "assistant" and not remote)

    def set_token_colours(self, mode: str) -> None:
        """Every reply token by token, coloured by probability or entropy, or as Markdown ("off"); kept."""
        self.settings.token_colours = self.chat.settings.token_colours = mode
        self.settings.save(self.qsettings)
        self.tokenLegend.show_mode(mode)
        for view in self.transcript.views:
            view.set_token_mode(mode)

    def _message_view(self, m, idx: int, count: int) -> MessageView:
        view = MessageView(m, idx, count, self.count_tokens)
        view.show_images(self.chat.store.images)
        view.set_token_mode(self.settings.token_colours if self.settings.token_colours in TOKEN_MODES else "off")
        view.editSubmitted.connect(self.edit_message)
        view.branchRequested.connect(self.switch_branch)
        view.selected.connect(self.select_message)
        view.compareRequested.connect(self.compare_reply)
        view.forkRequested.connect(self.fork_reply)
        view.firstTextPainted.connect(lambda t, mid=m.id: self._on_first_paint(mid, t))
        self._fit_view(view)  # a view added later (a chunk of the backfill) as well as those drawn now
        self._mark(view)
        return view

    def show_earlier(self) -> None:
        """Earlier messages above those shown (Ctrl+Up at the top, or the transcript's button)."""
        self.branch.show_earlier()

    def count_tokens(self, text: str) -> int | None:
        """Tokens in `text` by the local model's tokenizer (thinking blocks' counts); None on a remote engine."""
        return self.client.count_tokens(text)

    def select_message(self, mid: int) -> None:
        if self.chat.select_message(mid) is not None:
            self.pacer.mark_dirty()

    def switch_branch(self, mid: int, delta: int) -> None:
        if self.chat.switch_branch(mid, delta):
            self.render_transcript()
            self.probe_conversation()  # the meter and This conversation's rows follow the branch shown
            self.composer.setFocus()  # the clicked arrow's view is rebuilt: keystrokes go on to the message box

    # --- the chat controller's listener ------------------------------------------------------
    def transcript_changed(self) -> None:
        self.render_transcript()

    def reply_progressed(self) -> None:
        self.pacer.mark_dirty()

    def first_token(self) -> None:
        """Token 1 is drawn at once, text and panel, not at the next tick of the throttled redraw."""
        self.pacer.draw_now()

    def _on_first_paint(self, mid: int, t: float) -> None:
        stream = self.chat.streams.get(mid)
        stats = None if stream is None else stream.stats
        if stats is not None and stats.first_paint is None:
            stats.first_paint = t
            self._panel_at = 0.0  # the panel says so at the next redraw
            self.pacer.mark_dirty()

    def reply_finished(self, final, highlight) -> None:
        if self.chat.summary:
            self.statsPanel.show_summary(self.chat.summary)
        self.statsPanel.show_store(self.chat.store_state)
        self.probe_conversation()
        if highlight is not None:
            view = self.transcript.view_for(highlight[0])
            if view is not None:
                view.set_highlight(highlight[1], highlight[2])
        self.pacer.mark_dirty()
        self.pacer.tick()
        self.replyFinished.emit(final)

    # --- chatting ----------------------------------------------------------------------
    def _update_buttons(self) -> None:
        if self._closing:  # the store is closed: nothing is asked of it
            return
        ready = self.facts is not None and not self.loadProgress.isVisible()
        self._show_status_line()
        self.sendButton.setVisible(not self.generating)
        self.stopButton.setVisible(self.generating)
        self.sidebar.mark_streaming(set(self.chat.runs))  # a dot where a reply streams, in any conversation
        self.sendButton.setEnabled(ready)
        self.regenerateButton.setEnabled(ready and self.chat.can_regenerate())
        self.regenerateWith.setEnabled(ready and self.chat.can_regenerate())
        self.regenerateWith.set_greedy(self.chat.settings_for().temperature == 0)
        self.continueButton.setEnabled(ready and self.chat.can_continue())

    def send(self) -> None:
        self._send(now())  # the moment Send was pressed: TTFT counts from here

    def _send(self, arrival: float) -> None:
        """Send the draft, once the meter's reading is of this draft: one that cannot fit is refused before
        anything is stored (the draft stays in the box), under the policy that stops at the limit, or when
        leaving turns out cannot make it fit."""
        if self.facts is None or self.generating or not (self.composer.toPlainText().strip() or self.draft_images):
            return
        if not self._reading_is_current():
            self._send_when_probed = arrival  # asked now; sent when the answer comes (_on_probed)
            self.probeTimer.stop()
            self._probe_now()
            return
        why = refusal(self.seen, (self.facts or {}).get("capacity"), self.chat.settings_for().max_new_tokens)
        if why:
            self.show_error(why)
            return
        user = self.chat.send(self.composer.toPlainText(), arrival, self.draft_images)
        if user is None:
            return
        self.composer.clear()
        self.attachments.clear()
        self.regenerateHint.setVisible(False)
        self._fill_conversations()  # a new conversation, or a new title
        self.show_conversation_settings()
        self.start_reply(user, arrival)

    def edit_message(self, mid: int, text: str) -> None:
        """An edit makes a sibling branch; a user edit regenerates the reply through prefix reuse."""
        arrival = now()
        regenerate = self.chat.edit(mid, text)
        if regenerate is not None:
            self.start_reply(regenerate, arrival)
        else:
            self.render_transcript()
            self.probe_conversation()
        self.composer.setFocus()  # the edited view is rebuilt: focus would fall to the search field

    def regenerate(self) -> None:
        self._regenerate(same_model=True)

    def _regenerate(self, same_model: bool) -> None:
        """The last reply again (`same_model`: by the model that made it, which under greedy sampling repeats it;
        a button's clicked(bool) must not reach this flag)."""
        target = self.chat.regenerate_target()
        if target is not None:
            self.regenerateHint.setVisible(same_model and self.chat.settings_for().temperature == 0)
            self.start_reply(target, now())

    def alternatives(self, n: int) -> None:
        """`n` replies to the last message at once, in one batch: new branches sharing the prompt's prefill."""
        target = self.chat.regenerate_target()
        if target is not None:
            self.start_reply(target, now(), alternatives=n)

    def continue_reply(self) -> None:
        target = self.chat.continue_target()
        if target is not None:
            self.start_reply(target[0], now(), continue_mid=target[1])

    def fork_reply(self, mid: int, index: int, token: dict | None) -> None:
        """A new branch of reply `mid` from its token `index`, going on with `token` (None: drawn again)."""
        fork = self.chat.fork_target(mid, index, token)
        if fork is not None:
            self.start_reply(self.store.message(mid).parent_id, now(), fork=fork)

    def stop(self) -> None:
        self.chat.stop()

    def start_reply(self, parent_id: int, arrival: float, continue_mid=None, fork=None, alternatives: int = 1) -> None:
        run = self.chat.start(parent_id, arrival, continue_mid, fork, alternatives)  # None: this conversation's runs
        if run is None:
            return
        self.banner.setVisible(False)
        self._task = self.loop.create_task(run)
        self._tasks.add(self._task)
        self._task.add_done_callback(self._reply_done)
        self._update_buttons()
        self.composer.setFocus()  # a fork or regenerate rebuilt the views: not the search box, the message box

    def _reply_done(self, task: asyncio.Task) -> None:
        """A bug in the reply code must not leave the window stuck in 'generating'."""
        self._tasks.discard(task)
        self._update_buttons()
        if task.cancelled() or task.exception() is None:
            return
        self.show_error(f"Internal error while replying: {task.exception()!r}")
        self.render_transcript()

    def _redraw(self, panel: bool = False) -> None:
        """What the pacer's redraw shows: the streaming message's text, and the panel at most every
        PANEL_EVERY_S (`panel`: now)."""
        chat = self.chat
        for stream in chat.streams_in(chat.current_cid):  # those on screen (alternatives: the branch shown)
            view = self.transcript.view_for(stream.mid)
            if view is not None:
                view.set_content(stream.text, "streaming", stream.stats.tokens)
        if chat.busy and now() - self._panel_at < PANEL_EVERY_S and not panel:
            return
        self._panel_at = now()
        self.statsPanel.show_reply(chat.stats, chat.heading())
        if chat.busy or self.requestsView.listed:
            busy = chat.busy
            self.requestsView.show_streams(
                chat, self.client.in_flight() if busy else [], self.client.kv_pool() if busy else None
            )
        if not (panel and chat.busy):  # token 1's own draw leaves the map to the next panel tick
            self.statsPanel.show_cache_map(chat.cache_map, self.client.token_text)
        self._update_buttons()

    # --- closing -----------------------------------------------------------------------
    def closeEvent(self, e) -> None:
        """Stop a generation, wait for the worker, save the partial reply, then close."""
        if self._closing:
            e.accept()
            return
        self._closing = True
        self.hide()  # gone from the screen at once, even while the worker finishes a model load
        self.pacer.stop()
        self.chat.save_partial()
        self.worker_left_running = not self.client.close()
        if self.chat.tool_host is not None:
            self.chat.tool_host.close()  # the MCP servers it started stop with the app
        for task in list(self._tasks):
            task.cancel()
        self.heldBanner.timer.stop()
        self.probeTimer.stop()
        if not self.store.close():
            warn(
                self,
                "kvchat",
                f"Some changes could not be saved: {self.store.held_because}, and no file could be written "
                f"beside it ({self.store.held_path}).",
            )
        e.accept()
