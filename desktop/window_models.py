"""The main window's side of the engine and its settings: loading a model (or a remote engine) and what the
panel and the meter show of it, the Models and Settings dialogs, switching or comparing the model of a reply, the
exports (a trace, a conversation, the last reply to the clipboard). A part of MainWindow (desktop/window.py)."""

from __future__ import annotations

import dataclasses
import html
import json
import os
from pathlib import Path

from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication, QDialog, QFileDialog, QMessageBox

from engine.weights.catalog import is_bundled

from .core.settings import Settings
from .core.tool_host import ToolHost
from .core.tool_turns import ALLOWED_KEY
from .export_import import export_conversation, import_conversation
from .models_dialog import ModelsDialog
from .panel_parts import set_bar
from .reply_widgets import CodeBlock
from .settings_dialog import SettingsDialog
from .style import apply_style
from .tool_approval import ToolApproval

GREEDY_HINT = (
    "Greedy sampling (temperature 0): Regenerate gives the same reply again. Raise the temperature "
    "(kvchat → Settings…, This conversation) for a different one."
)


class ModelSide:
    """MainWindow's handling of the engine's answers and the settings (mixed into it: `self` is the window)."""

    # --- model -------------------------------------------------------------------------
    def load_model(self) -> None:
        self.client.load(self.settings.engine())

    def _on_model_loading(self, what: str) -> None:
        self.loadProgress.setRange(0, 0)  # busy until the first figure arrives
        self.loadProgress.setVisible(True)
        self.statusBar().showMessage(f"Loading {what}…")
        self._update_buttons()

    def _on_load_progress(self, fraction: float, what: str) -> None:
        """The weights being read: a percentage, with the file's name."""
        pct = int(round(fraction * 100))
        set_bar(self.loadProgress, 100, pct, f"{pct}%")
        self.loadProgress.setTextVisible(True)
        self.statusBar().showMessage(f"Loading {what}: {pct}%")

    def open_models_dialog(self) -> ModelsDialog:
        """The models on this computer; the one picked is loaded (and kept in the settings)."""
        dlg = ModelsDialog(self.settings.folders, self.settings.model.path, self)
        dlg.finished.connect(lambda result: self._models_chosen(dlg, result))
        dlg.open()
        return dlg

    def _models_chosen(self, dlg: ModelsDialog, result: int) -> None:
        new = dataclasses.replace(self.settings, model_folders=os.pathsep.join(dlg.folders))
        if result == QDialog.Accepted and dlg.chosen:
            new.model = dataclasses.replace(new.model, path=None if is_bundled(dlg.chosen) else dlg.chosen)
            new.backend = "local"  # a model on this computer was picked: run it here
        self.apply_settings(new)

    def _on_model_loaded(self, facts: dict) -> None:
        self.facts = self.chat.engine_facts = facts
        self.loadProgress.setVisible(False)
        self.statsPanel.show_model(facts)
        self.requestsView.show_model(facts, self.client.server_load if facts.get("backend") == "remote" else None)
        self.chat.lane_maps.loaded(facts)
        self.statsPanel.show_cache_map(self.chat.cache_map, self.client.token_text)
        self.transcript.show_start(facts)
        self.statsPanel.show_store(facts["cache"].get("store"))
        self.show_conversation_settings()  # its tools may be off under this model
        self.probe_conversation()
        if facts.get("backend") == "remote":
            note = f"Connected: {facts['name']} at {facts['server']} ({facts.get('server_kind')} server)."
        else:
            note = f"Model {facts['name']} ready on {facts['device']} ({facts['dtype']})."
            if facts.get("warm_up_ms") is not None:  # paid here, at load, not by the first reply
                note = note[:-1] + f", warmed up in {facts['warm_up_ms']:,.0f} ms."
        if self.chat.stats.status != "idle":  # the reply shown keeps its own figures, made where it was made
            self.statsPanel.show_reply(self.chat.stats, self.chat.heading())
        if facts.get("cache_dropped"):
            note += f" {facts['cache_dropped']}."
            self.statsPanel.set("reuseReasonValue", f"for the next request: {facts['cache_dropped']}")
        self.statusBar().showMessage(note, 10000)
        self.show_meter()
        if facts.get("backend") != "remote":
            path = self.settings.model.path
            self.settings.remember(None if is_bundled(path) else path)  # the demo by any of its names: one entry
            self.settings.save(self.qsettings)
        self.show_models()
        self._update_buttons()
        self.modelReady.emit(facts)
        if self._regenerate_on_load:
            self._regenerate_on_load = False
            self._regenerate(same_model=False)

    def show_models(self) -> None:
        """The model in use and the recent ones, in the switcher and in Regenerate with…"""
        remote = None
        if (self.facts or {}).get("backend") == "remote":
            remote = f"{self.facts['name']} (remote)"
        current, recent = self.settings.model.path, self.settings.recent()
        current = None if is_bundled(current) else current
        self.modelSwitch.show_models(current, recent, remote)
        self.regenerateWith.show_models([p for p in recent if remote or p != current])

    def _on_model_failed(self, error: str) -> None:
        self._regenerate_on_load = False
        self.loadProgress.setVisible(False)
        keep = " The previous model is still in use." if self.facts else ""
        self.show_error(f"The model could not be loaded: {error}.{keep}")
        self._update_buttons()
        self.modelReady.emit({"error": error})

    def open_settings_dialog(self) -> None:
        dlg = SettingsDialog(self.chat.settings_for(), self.db_path, self)
        if dlg.exec():
            self.apply_settings(dlg.result_settings(), conversation=True)

    def apply_settings(self, new: Settings, conversation: bool = False) -> None:
        """New settings for the app; with `conversation`, the system prompt and sampling are also the
        conversation's own (the Settings dialog edits those of the conversation shown)."""
        cid = self.chat.current_cid
        if conversation and cid is not None:  # what it allowed without asking stays (tool_turns.allow_tool)
            kept = {k: v for k, v in (self.store.conversation(cid).settings or {}).items() if k == ALLOWED_KEY}
            self.chat.guard(self.store.set_settings, cid, {**new.conversation_part(), **kept})
        reload = new.engine() != self.settings.engine()
        self.settings = self.chat.settings = new
        self.set_tool_servers(new)
        self.statsPanel.drafting = new.speculative
        new.save(self.qsettings)
        self.show_conversation_settings()
        self.show_meter()  # max new tokens may have changed
        self.probe_conversation()  # and the overflow policy: what Send would leave out
        if reload:
            self.load_model()

    def set_tool_servers(self, settings: Settings) -> None:
        """The MCP servers' host for the configured servers (none started until a conversation needs its tools);
        a changed configuration stops the servers running and forgets their tools."""
        old = self.chat.tool_host
        servers = settings.tool_servers()
        if old is not None and old.servers == servers:
            return
        if old is not None:
            old.close()
        self.chat.tool_host = ToolHost(servers) if servers else None
        self.chat.tool_listing.clear()

    def approve_call(self, cid: int, call, tool):
        """The person's answer to a tool call (a Future: once, conversation, deny), asked in its own window."""
        question = ToolApproval(self.store.conversation(cid).title, call, tool, self)
        question.answer.add_done_callback(lambda _: question.settle())  # answered by Stop: the question goes
        self.approval = question
        question.show()
        question.raise_()
        return question.answer

    def show_conversation_settings(self) -> None:
        """The conversation's own system prompt and sampling, above its messages; and what Regenerate does
        under them (greedy sampling repeats the reply: its tooltip, and the hint after a click, say so)."""
        own = self.chat.settings_for()
        grammar = own.grammar_or_none()
        self.statsPanel.reply_format = grammar.describe() if grammar is not None else ""
        greedy = own.temperature == 0
        self.regenerateButton.setToolTip(
            GREEDY_HINT if greedy else "Run the last reply again: a new version ‹n/n› beside the others"
        )
        self.regenerateHint.setText(GREEDY_HINT)
        if not greedy:
            self.regenerateHint.setVisible(False)
        if self.chat.current_cid is None:
            self.conversationSettingsLabel.setVisible(False)
            return
        off = "" if self.chat.model_takes_tools() else "this model's chat template takes no tools"
        self.conversationSettingsLabel.setText(own.conversation_summary(off))
        self.conversationSettingsLabel.setVisible(True)

    def show_about(self) -> None:
        QMessageBox.about(
            self,
            "About kvchat",
            f"<b>kvchat</b> — a local chat that shows inference as it happens.<br><br>"
            f"Conversations: {html.escape(str(self.db_path))}<br>"
            f"Settings: {html.escape(str(self.data_directory / 'settings.ini'))}",
        )

    def _show_status_line(self) -> None:
        """The engine and model in use and the conversation's share of the cache, in the status bar."""
        f = self.facts
        if f is None:
            text = "Loading the model…" if self.loadProgress.isVisible() else "No model loaded"
        else:
            where = f"at {f['server']}" if f.get("backend") == "remote" else f"on {f['device']}"
            cap = f.get("capacity")
            text = f"{'Replying' if self.generating else 'Ready'} · {f['name']} {where}"
            text += f" · capacity {cap:,} positions" if cap else ""
            n = len(self.chat.streams)
            text += f" · {n} replies streaming" if n > 1 or (n and not self.generating) else ""
        if self.statusLine.text() != text:
            self.statusLine.setText(text)

    def show_error(self, text: str) -> None:
        self.banner.setText(text)
        self.banner.setVisible(True)
        self.statusBar().showMessage(text, 15000)

    def switch_model(self, path: str | None) -> None:
        """Run this computer's model `path` (None: the demo model) from the next reply on; the transcript marks
        the change at the first reply it makes."""
        if self.chat.busy:  # a reply in any conversation runs on the model loaded now
            return
        new = dataclasses.replace(self.settings, model=dataclasses.replace(self.settings.model, path=path))
        new.backend = "local"
        self.apply_settings(new)

    def regenerate_with(self, path: str | None) -> None:
        """The last reply made again by model `path`, once it has loaded: a new branch, labelled with it."""
        if self.chat.busy or self.chat.regenerate_target() is None:
            return
        self._regenerate_on_load = True
        self.switch_model(path)

    def compare_reply(self, mid: int) -> None:
        """Rerun the prompt of this reply at the other precision (in the worker) and show both."""
        if self.generating or self.facts is None:
            return
        upto = self.chat.messages_until(self.store.message(mid).parent_id)
        self._compare_rid = getattr(self, "_compare_rid", 0) + 1
        self.statusBar().showMessage("Comparing with the other precision…")
        self.client.compare(self._compare_rid, self.chat.messages(upto), self.settings.max_new_tokens)

    def _on_compared(self, rid: int, result: dict) -> None:
        from .compare import CompareDialog

        self.statusBar().clearMessage()
        self.last_comparison = result
        self.compareDialog = CompareDialog(result, self)
        self.compareDialog.show()

    def export_trace(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export trace", "kvchat-trace.json", "JSON (*.json)")
        if path:
            self.write_trace(Path(path))

    def write_trace(self, path: Path) -> None:
        record = {"message_id": self.chat.selected_mid, **self.stats.to_json(), "model": self.facts}
        path.write_text(json.dumps(record, indent=2, ensure_ascii=False))

    def set_theme(self, choice: str) -> None:
        """Dark, light, or as the system says (kept in the settings)."""
        self.settings.theme = self.chat.settings.theme = choice
        self.settings.save(self.qsettings)
        self.apply_theme()

    def apply_theme(self) -> None:
        app = QApplication.instance()
        if app is None:
            return
        apply_style(app, self.settings.theme)
        for block in self.findChildren(CodeBlock):
            block.rehighlight()

    def export_conversation(self, path: str | None = None) -> None:
        export_conversation(self, path)

    def import_conversation(self, path: str | None = None) -> None:
        import_conversation(self, path)

    def copy_last_reply(self) -> None:
        """The newest reply on the branch shown, to the clipboard (Ctrl+Shift+C)."""
        replies = [v.message for v in self.transcript.views if v.message.role == "assistant"]
        if replies:
            QGuiApplication.clipboard().setText(replies[-1].content)
            self.statusBar().showMessage("The last reply is on the clipboard.", 3000)
