"""The Settings dialog's "Tools" tab: the MCP servers (every conversation's), in the `{"mcpServers": {…}}` shape other
apps write — typed, or imported from such a file, checked as typed — and which of their tools this conversation
offers the model, listed with their descriptions when the person asks (the servers are started then, and only
then, on a thread of their own), and whether the first reply to each message must call one."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPlainTextEdit,
    QPushButton,
    QWidget,
)

from .core.settings import Settings
from .core.tool_host import ToolHost
from .core.tool_servers import ConfigError, read_file, read_servers, tool_key
from .outside_text import plain, plain_tooltip

PLACEHOLDER = (
    '{"mcpServers": {"weather": {"command": "uvx", "args": ["mcp-weather"]}, "docs": {"url": "https://…/mcp"}}}'
)
CHOICES = (("The model decides", "auto"), ("The first reply to each message calls one", "required"))
HELP = (
    "Every call is shown to you with its arguments and runs only when you allow it; its result is added to the "
    "conversation and the reply goes on from it, every earlier position of the cache kept. A call has a time "
    "limit and its result is cut at 32,000 characters. The model must know tools: its chat template says so."
)
POLL_MS = 50


class ToolsPage(QWidget):
    """`servers_text()`, `tool_keys()`, `tool_choice()`; `problem()`: why the servers' text does not read."""

    def __init__(self, settings: Settings, parent=None):
        super().__init__(parent)
        form = QFormLayout(self)
        self.servers = QPlainTextEdit(settings.mcp_servers)
        self.servers.setObjectName("mcpServersEdit")
        self.servers.setAccessibleName("MCP servers (all conversations)")
        self.servers.setPlaceholderText(PLACEHOLDER)
        self.servers.setFont(QFontDatabase.systemFont(QFontDatabase.FixedFont))
        self.servers.setMaximumHeight(120)
        form.addRow("MCP servers (all conversations)", self.servers)
        self.importButton = QPushButton("Import a file…")
        self.importButton.setObjectName("importServersButton")
        self.importButton.setToolTip("A claude_desktop_config.json, mcp.json or the like: its mcpServers are read")
        self.importButton.clicked.connect(self.import_file)
        self.status = plain(QLabel())
        self.status.setObjectName("mcpServersStatus")
        self.status.setWordWrap(True)
        row = QHBoxLayout()
        row.addWidget(self.status, 1)
        row.addWidget(self.importButton, 0, Qt.AlignTop)
        form.addRow("", row)
        self.listButton = QPushButton("List their tools")
        self.listButton.setObjectName("listToolsButton")
        self.listButton.setToolTip("Starts each server and asks it for its tools")
        self.listButton.clicked.connect(self.list_tools)
        self.tools = QListWidget()
        self.tools.setObjectName("toolsList")
        self.tools.setAccessibleName("Tools this conversation offers")
        form.addRow("Tools in this conversation", self.listButton)
        form.addRow("", self.tools)
        self.choice = QComboBox()
        self.choice.setObjectName("toolChoiceCombo")
        for words, key in CHOICES:
            self.choice.addItem(words, key)
        self.choice.setCurrentIndex(max(0, self.choice.findData(settings.tool_choice)))
        form.addRow("Calls", self.choice)
        said = plain(QLabel(HELP))
        said.setWordWrap(True)
        form.addRow(said)
        self.setToolTip(plain_tooltip(HELP))
        for key in settings.tool_keys():  # what is on, before the servers are asked
            self._item(key, "", True)
        self._host: ToolHost | None = None
        self._pending: list = []
        self._timer = QTimer(self)
        self._timer.setInterval(POLL_MS)
        self._timer.timeout.connect(self._poll)
        self.servers.textChanged.connect(self._check)
        self._check()

    # --- the servers' text ----------------------------------------------------------------------------------------
    def servers_text(self) -> str:
        return self.servers.toPlainText().strip()

    def _read(self) -> tuple[dict, str]:
        """(the servers the text holds, why it does not read: "" where it does)."""
        try:
            return read_servers(self.servers_text()), ""
        except ConfigError as e:
            return {}, str(e)

    def problem(self) -> str:
        return self._read()[1]

    def _check(self) -> None:
        servers, why = self._read()
        if why:
            self.status.setText(f"Not read: {why}")
            return
        if not servers:
            self.status.setText("No servers: the model is offered no tools.")
            return
        self.status.setText("; ".join(f"{name}: {s.describe()[:80]}" for name, s in servers.items()))

    def import_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Import MCP servers", "", "JSON (*.json);;All files (*)")
        if not path:
            return
        try:
            self.servers.setPlainText(read_file(path))
        except (ConfigError, OSError) as e:
            self.status.setText(f"Not imported: {e}")

    # --- the tools ------------------------------------------------------------------------------------------------
    def tool_keys(self) -> list[str]:
        return [it.data(Qt.UserRole) for it in self._items() if it.checkState() == Qt.Checked]

    def tool_choice(self) -> str:
        return self.choice.currentData()

    def _items(self) -> list[QListWidgetItem]:
        return [self.tools.item(i) for i in range(self.tools.count())]

    def _item(self, key: str, description: str, on: bool) -> None:
        item = next((it for it in self._items() if it.data(Qt.UserRole) == key), None)
        if item is None:
            item = QListWidgetItem()
            item.setData(Qt.UserRole, key)
            item.setFlags(item.flags() | Qt.ItemIsUserCheckable)
            item.setCheckState(Qt.Checked if on else Qt.Unchecked)
            self.tools.addItem(item)
        item.setText(f"{key} — {description[:120]}" if description else key)
        item.setToolTip(plain_tooltip(description) if description else "")

    def list_tools(self) -> None:
        """Start the servers typed here and list their tools (each server's failure said in the status line)."""
        servers, why = self._read()
        if why:
            return
        self.close_host()
        self._host = ToolHost(servers)
        self._pending = [(name, self._host.submit_tools(name)) for name in servers]
        self.listButton.setEnabled(False)
        self.status.setText("Asking " + ", ".join(servers) + "…")
        self._failed: list[str] = []
        self._timer.start()

    def _poll(self) -> None:
        left = []
        for name, future in self._pending:
            if not future.done():
                left.append((name, future))
                continue
            try:
                for t in future.result():
                    self._item(tool_key(name, t.tool.name), t.tool.description, False)
            except Exception as e:  # the server's failure is said here; the others' tools are still listed
                self._failed.append(f"{name}: {e}")
        self._pending = left
        if not left:
            self._timer.stop()
            self.listButton.setEnabled(True)
            self.status.setText("; ".join(self._failed) if self._failed else f"{self.tools.count()} tools listed.")
            self.close_host()

    def close_host(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None
