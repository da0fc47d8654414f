"""The window's menus and their shortcuts: the app's (models, settings, export, about, quit) and the chat's
(new, search, stop, copy, moving between messages), active whatever has the focus."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QKeySequence


def build_menus(window) -> None:
    menu = window.menuBar().addMenu("&kvchat")
    for text, slot, key in (
        ("Models…", window.open_models_dialog, "Ctrl+O"),
        ("Settings…", window.open_settings_dialog, "Ctrl+,"),
        ("Export conversation…", lambda: window.export_conversation(), "Ctrl+E"),
        ("Import conversation…", lambda: window.import_conversation(), None),
        ("About", window.show_about, None),
        ("Quit", window.close, "Ctrl+Q"),
    ):
        act = QAction(text, window)
        act.triggered.connect(slot)
        if key:
            act.setShortcut(QKeySequence(key))
        menu.addAction(act)
    chat = window.menuBar().addMenu("&Chat")
    for text, slot, key in (
        ("New conversation", window.new_conversation, "Ctrl+N"),
        ("Search conversations", window.focus_search, "Ctrl+F"),
        ("Stop the reply", window.stop, "Esc"),
        ("Copy the last reply", window.copy_last_reply, "Ctrl+Shift+C"),
        ("Previous message", window.previous_message, "Ctrl+Up"),
        ("Next message", window.next_message, "Ctrl+Down"),
    ):
        act = QAction(text, window)
        act.setObjectName(f"action-{slot.__name__}")
        act.triggered.connect(slot)
        act.setShortcut(QKeySequence(key))
        act.setShortcutContext(Qt.WindowShortcut)
        chat.addAction(act)
        window.addAction(act)  # active whatever has the focus, menu shown or not
