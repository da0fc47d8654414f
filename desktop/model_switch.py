"""The model in use, above the conversation, with a quick switch to the models used lately; and the menu that
regenerates the last reply with one of them (a new branch, labelled with the model that made it)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QMenu, QToolButton, QWidget

from .outside_text import plain

OTHER = "other"  # the switcher's last item: the Models dialog
NAME_CHARS = 22  # the switcher's width in characters: a longer model name is cut there, whole in the tooltip


def model_name(path: str | None) -> str:
    """A model's name as the switcher shows it: the file or folder's name (the demo: kvchat-demo)."""
    return "kvchat-demo (bundled)" if path is None else Path(path).name or path


TIP = "the model that answers in this conversation now; pick another one to switch to it"


class ModelSwitch(QWidget):
    """'Model: <the model in use> ▾': the recent models, then 'Other models…'. `switchTo` carries the path
    chosen (None: the demo model); `browse` the wish for the Models dialog."""

    switchTo = Signal(object)
    browse = Signal()

    def __init__(self):
        super().__init__()
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(plain(QLabel("Model:")))
        self.combo = QComboBox()
        self.combo.setObjectName("modelSwitch")
        self.combo.setAccessibleName("Model in use")
        self.combo.setToolTip(TIP)
        self.combo.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)  # a long file name is cut
        self.combo.setMinimumContentsLength(NAME_CHARS)  # (the tooltip has it whole), never the window's width
        self.combo.setMinimumWidth(self.combo.fontMetrics().averageCharWidth() * NAME_CHARS // 2)  # narrower still
        self.combo.activated.connect(self._picked)
        lay.addWidget(self.combo)
        self.paths: list[str | None] = []

    def show_models(self, current: str | None, recent: list[str | None], remote: str | None = None) -> None:
        """The model in use first (`remote`: a server's model, named so), then the other recent local ones."""
        self.combo.blockSignals(True)
        self.combo.clear()
        self.paths = ([] if remote else [current]) + [p for p in recent if remote or p != current]
        if remote:
            self.combo.addItem(remote, "remote")
        for p in self.paths:
            self.combo.addItem(model_name(p), p)
            self.combo.setItemData(self.combo.count() - 1, p or model_name(p), Qt.ToolTipRole)
        self.combo.addItem("Other models…", OTHER)
        self.combo.setCurrentIndex(0)
        self.combo.setToolTip(f"{self.combo.itemText(0)}: {TIP}")
        self.combo.blockSignals(False)

    def _picked(self, index: int) -> None:
        data = self.combo.itemData(index)
        self.combo.setCurrentIndex(0)  # the model in use stays shown until the switch has loaded
        if data == OTHER:
            self.browse.emit()
        elif index > 0:  # the first item is the model in use
            self.switchTo.emit(data)


ALTERNATIVES = (2, 3, 4)  # Alternatives ×N: the counts offered (the app runs up to 4 replies at once)
ALTERNATIVES_GREEDY = "need a temperature above 0: greedy, they would all be one reply (Settings → Sampling)"


class RegenerateWith(QToolButton):
    """'Regenerate with…': the last reply again as N alternatives at once (`alternatives` carries N: one batch, the
    prompt prefilled once), or by another of the recent models (`chosen` carries its path)."""

    chosen = Signal(object)
    alternatives = Signal(int)

    def __init__(self):
        super().__init__()
        self.setObjectName("regenerateWithButton")
        self.setText("Regenerate with…")
        self.setAccessibleName("Regenerate the last reply with another model")
        self.setToolTip(
            "The last reply made again: as 2–4 alternatives at once (each a branch of its own, ‹ › between them; one "
            "batch on the engine, the prompt prefilled once, each sampled with its own seed), or by another model: a "
            "new branch, labelled with the model. The app then stays on that model for what follows; Model: above "
            "switches back."
        )
        self.setPopupMode(QToolButton.InstantPopup)
        self.setMenu(QMenu(self))

        self.menu().setToolTipsVisible(True)
        self.greedy = False
        self.counts: list = []  # the menu's alternatives actions (set_greedy greys them)
        self.show_models([])

    def show_models(self, others: list[str | None]) -> None:
        menu = self.menu()
        menu.clear()
        menu.addSection("This model, several at once")
        self.counts = [menu.addAction(f"{n} alternatives", lambda n=n: self.alternatives.emit(n)) for n in ALTERNATIVES]
        self._fit_counts()
        if others:
            menu.addSection("Another model")
        for p in others:
            menu.addAction(f"{model_name(p)} (and keep it loaded)", lambda p=p: self.chosen.emit(p))

    def set_greedy(self, greedy: bool) -> None:
        """Under greedy sampling the alternatives would be one reply N times: offered, greyed, saying why."""
        if greedy != self.greedy:
            self.greedy = greedy
            self._fit_counts()

    def _fit_counts(self) -> None:
        for n, action in zip(ALTERNATIVES, self.counts):
            action.setEnabled(not self.greedy)
            action.setToolTip(f"Alternatives {ALTERNATIVES_GREEDY}" if self.greedy else f"{n} replies in one batch")
