"""The main window's widgets and how they are laid out: sidebar, transcript, composer with its meter, the panel,
the menus; the splitter kept to the window's width. A part of MainWindow (desktop/window.py)."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QSplitter,
    QStatusBar,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from .attachments import AttachmentStrip
from .branch_view import BranchView
from .composer import Composer
from .context_meter import ContextMeter
from .held_banner import HeldBanner
from .menus import build_menus
from .model_switch import ModelSwitch, RegenerateWith
from .outside_text import plain
from .pacing import RedrawPacer
from .panel import StatsPanel
from .requests_view import RequestsView
from .sidebar import Sidebar
from .style import THEMES, button
from .token_view import MODES as TOKEN_MODES
from .token_view import TokenLegend
from .transcript import Transcript

PROBE_DELAY_MS = 250  # a conversation opened is probed for its cached share this long after (once drawn)
SIDEBAR_SHARE, PANEL_SHARE = 0.2, 0.3  # of the window's width, at most, when it is too narrow for all three


class StatusBar(QStatusBar):
    """The status bar, whose passing messages end where its permanent widgets (the load bar, the theme box)
    begin: a long one is cut with "…" and said whole in its tooltip, not drawn under them."""

    def __init__(self):
        super().__init__()
        self.permanent: list[QWidget] = []
        self.whole, self.cut = "", ""

    def addPermanentWidget(self, widget, stretch=0):
        self.permanent.append(widget)
        super().addPermanentWidget(widget, stretch)

    def showMessage(self, text: str, timeout: int = 0) -> None:
        room = self.width() - sum(w.width() + 8 for w in self.permanent if w.isVisible()) - 16
        cut = self.fontMetrics().elidedText(text, Qt.ElideRight, max(room, 80)) if self.isVisible() else text
        self.whole, self.cut = text, cut
        self.setToolTip(text if cut != text else "")
        super().showMessage(cut, timeout)

    def currentMessage(self) -> str:
        """The message whole, as it was given (the bar may show it cut)."""
        shown = super().currentMessage()
        return self.whole if shown and shown == self.cut else shown


class WindowLayout:
    """MainWindow's building of its widgets (mixed into it: `self` is the window)."""

    # --- layout ------------------------------------------------------------------------
    def _build(self) -> None:
        self.setStatusBar(StatusBar())
        self.sidebar = Sidebar(self)
        self.sidebar.searchChanged.connect(self._fill_conversations)
        self.sidebar.picked.connect(self._on_conversation_picked)
        self.search, self.conversationList = self.sidebar.search, self.sidebar.list  # the window's parts, by name
        for name in ("newButton", "renameButton", "deleteButton", "exportButton", "importButton", "undoButton"):
            setattr(self, name, getattr(self.sidebar, name))

        center = self.centerColumn = QWidget()
        cl = QVBoxLayout(center)
        self.banner = plain(QLabel())
        self.banner.setObjectName("errorBanner")
        self.banner.setWordWrap(True)
        self.banner.setVisible(False)
        cl.addWidget(self.banner)
        self.heldBanner = HeldBanner(lambda: self.store, self.show_error, self.statusBar().showMessage)
        cl.addWidget(self.heldBanner)
        self.probeTimer = QTimer(self)
        self.probeTimer.setSingleShot(True)
        self.probeTimer.setInterval(PROBE_DELAY_MS)
        self.probeTimer.timeout.connect(self._probe_now)
        self.conversationSettingsLabel = plain(QLabel())
        self.conversationSettingsLabel.setObjectName("conversationSettingsLabel")
        self.conversationSettingsLabel.setWordWrap(True)
        self.conversationSettingsLabel.setToolTip("This conversation's own settings (kvchat → Settings… changes them)")
        self.conversationSettingsLabel.setVisible(False)
        cl.addWidget(self.conversationSettingsLabel)
        tokens_row = QHBoxLayout()
        self.modelSwitch = ModelSwitch()
        self.modelSwitch.switchTo.connect(self.switch_model)
        self.modelSwitch.browse.connect(self.open_models_dialog)
        tokens_row.addWidget(self.modelSwitch)
        self.tokenColours = QComboBox()
        self.tokenColours.setObjectName("tokenColours")
        self.tokenColours.setAccessibleName("Colour each reply's tokens by")
        self.tokenColours.setToolTip(
            "Show finished replies token by token, coloured by the chosen token's probability or by the entropy "
            "at its step; hover a token, or click it and use Left/Right, for what else the model weighed"
        )
        for mode, words in TOKEN_MODES.items():
            self.tokenColours.addItem(words, mode)
        mode = self.settings.token_colours if self.settings.token_colours in TOKEN_MODES else "off"
        self.tokenColours.setCurrentIndex(list(TOKEN_MODES).index(mode))
        self.tokenColours.currentIndexChanged.connect(lambda _: self.set_token_colours(self.tokenColours.currentData()))
        tokens_row.addWidget(self.tokenColours)
        tokens_row.addStretch(1)
        cl.addLayout(tokens_row)
        self.tokenLegend = TokenLegend()  # its own line, wrapped in a narrow window
        self.tokenLegend.show_mode(mode)
        cl.addWidget(self.tokenLegend)
        self.transcript = Transcript()
        self.branch = BranchView(
            self.transcript, lambda: self.chat, self._message_view, self._fit_view, self._update_buttons,
            lambda: self._closing,
        )  # fmt: skip
        self.pacer = RedrawPacer(self, self._redraw, lambda: self.chat.busy)  # a reply streams, in any conversation
        cl.addWidget(self.transcript, 1)
        actions = QHBoxLayout()
        self.regenerateButton = button("Regenerate", "regenerateButton", self.regenerate, actions)
        self.regenerateWith = RegenerateWith()
        self.regenerateWith.chosen.connect(self.regenerate_with)
        self.regenerateWith.alternatives.connect(self.alternatives)
        actions.addWidget(self.regenerateWith)
        self.continueButton = button("Continue", "continueButton", self.continue_reply, actions)
        self.regenerateHint = plain(QLabel())  # under greedy sampling, why Regenerate gives the same reply
        self.regenerateHint.setObjectName("regenerateHint")
        self.regenerateHint.setWordWrap(True)
        self.regenerateHint.setVisible(False)
        actions.addStretch(1)
        cl.addLayout(actions)
        cl.addWidget(self.regenerateHint)  # its own line, the transcript's width: never a column beside the buttons
        self.attachments = AttachmentStrip()  # the draft's images, over the message box
        self.attachments.changed.connect(self.probe_conversation)  # the meter counts their positions
        cl.addWidget(self.attachments)
        comp = QHBoxLayout()
        self.composer = Composer()
        self.composer.setObjectName("composer")
        self.composer.setPlaceholderText("Message the model (Enter sends, Shift+Enter for a new line)")
        self.composer.setMaximumHeight(110)
        self.composer.setTabChangesFocus(True)  # Tab leaves the composer, as in any form
        self.composer.setAccessibleName("Message to the model")
        self.composer.submitted.connect(self.send)
        self.composer.stopRequested.connect(self.stop)
        self.composer.imagesGiven.connect(self.attach_images)
        self.composer.imagesRefused.connect(lambda why: self.show_error("Not attached: " + "; ".join(why)))
        self.attachButton = button("Image…", "attachButton", self.choose_images, comp)  # left of the box, as usual
        comp.setAlignment(self.attachButton, Qt.AlignTop)  # level with the box's first line: Tab reaches it first
        self.attachButton.setToolTip("Attach images for the model to see (or paste one, or drop image files here)")
        comp.addWidget(self.composer, 1)
        self.sendButton = button("Send", "sendButton", self.send, comp)
        self.stopButton = button("Stop", "stopButton", self.stop, comp)
        self.stopButton.setVisible(False)
        cl.addLayout(comp)
        self.contextMeter = ContextMeter()
        cl.addWidget(self.contextMeter)
        self.seen: dict | None = None  # the last probe's answer: the conversation's cached share, the next Send's size
        self.composer.textChanged.connect(self.probe_conversation)  # the meter follows what is typed

        self.statsPanel = StatsPanel()
        self.statsPanel.exportRequested.connect(self.export_trace)
        self.statsPanel.drafting = self.settings.speculative  # a reply made without drafts says what is set now
        self.requestsView = RequestsView()  # every request in flight on the engine, side by side
        self.panelTabs = QTabWidget()
        self.panelTabs.setObjectName("panelTabs")
        self.panelTabs.addTab(self.statsPanel, "This reply")
        self.panelTabs.addTab(self.requestsView, "Requests")
        self.panelTabs.setTabToolTip(1, "Every request in flight: queue, prefill, tokens, KV share, batch, timeline")
        split = QSplitter()
        split.addWidget(self.sidebar)
        split.addWidget(center)
        split.addWidget(self.panelTabs)
        split.setSizes([210, 780, 390])
        split.setStretchFactor(1, 1)
        split.setChildrenCollapsible(False)  # a drag stops at each side's minimum: the panel cannot be lost
        split.setHandleWidth(6)  # a handle a person can find and grab
        self.splitter = split
        self.setCentralWidget(split)

        self.statusLine = plain(QLabel())  # what is in use, under any passing message (never a blank bar)
        self.statusLine.setObjectName("statusLine")
        self.statusBar().addWidget(self.statusLine, 1)
        self.loadProgress = QProgressBar()
        self.loadProgress.setObjectName("loadProgress")
        self.loadProgress.setRange(0, 0)
        self.loadProgress.setMaximumWidth(160)
        self.loadProgress.setToolTip("Loading the model: the share of its weights read so far")
        self.loadProgress.setVisible(False)
        self.statusBar().addPermanentWidget(self.loadProgress)
        self.themeSwitch = QComboBox()
        self.themeSwitch.setObjectName("themeSwitch")
        self.themeSwitch.setAccessibleName("Theme")
        names = {"system": "Theme: as the system", "dark": "Dark", "light": "Light"}
        for choice in THEMES:
            self.themeSwitch.addItem(names[choice], choice)
        self.themeSwitch.setCurrentIndex(THEMES.index(self.settings.theme) if self.settings.theme in THEMES else 0)
        self.themeSwitch.currentIndexChanged.connect(lambda _: self.set_theme(self.themeSwitch.currentData()))
        self.statusBar().addPermanentWidget(self.themeSwitch)
        QGuiApplication.styleHints().colorSchemeChanged.connect(lambda _: self.apply_theme())
        build_menus(self)

    def resizeEvent(self, e) -> None:
        super().resizeEvent(e)
        self._fit_splitter()

    def showEvent(self, e) -> None:
        super().showEvent(e)
        QTimer.singleShot(0, self._fit_splitter)  # the splitter shares out its width at the first show, after resizes

    def _fit_splitter(self) -> None:
        """In a narrow window the list and the panel give way to the conversation, down to their minimum
        widths (never wider than a share of the window: the transcript keeps room for a message's row)."""
        side, center, panel = self.splitter.sizes()
        total = side + center + panel
        side_max = max(self.sidebar.minimumSizeHint().width(), int(SIDEBAR_SHARE * total))
        panel_max = max(self.statsPanel.minimumWidth(), int(PANEL_SHARE * total))
        if side > side_max or panel > panel_max:
            side, panel = min(side, side_max), min(panel, panel_max)
            self.splitter.setSizes([side, total - side - panel, panel])
