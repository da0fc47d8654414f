"""The settings dialog, and the QSettings file (settings.ini in the data directory) settings live in."""

from __future__ import annotations

import dataclasses
import html
import json
import threading
from pathlib import Path

from PySide6.QtCore import QObject, QSettings, Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine.devices import DTYPES
from engine.errors import EngineError
from engine.http.remote import RemoteSpec, list_models
from engine.quant import ACTIVATIONS, PRECISIONS
from engine.session import DEFAULT_CAPACITY, OVERFLOW_POLICIES
from engine.spec import LoadSpec
from engine.speculative import MAX_TOKENS

from .core.settings import DEFAULT_OVERFLOW, SYSTEM_PRESETS, Settings
from .mcp_page import ToolsPage
from .outside_text import plain, plain_tooltip, rich
from .reply_format_page import ReplyFormatPage

OVERFLOW_HELP = (
    "What Send does when the conversation, with the reply's max new tokens, no longer fits the KV cache. "
    "Stop at the limit: Send is refused with the reason. Drop the oldest messages: the oldest turns (a message "
    "of yours and its reply) are left out until it fits. Truncate the middle: the turns after the first one are "
    "left out, oldest first, so the first turn stays. The system prompt and your last message always stay; the "
    "transcript marks what the model no longer sees, and the panel says how many positions went."
)

DRAFT_CHOICES = (("Off", ""), ("The model itself in int4", "int4"), ("Lookup in the conversation", "lookup"),
                 ("A draft model…", "model"))  # fmt: skip
DRAFT_HELP = (
    "Speculative decoding: a cheap draft proposes the next few tokens and the model checks them all in one pass, "
    "keeping those it would have chosen itself (a greedy reply is the same token for token). The int4 copy of the "
    "model drafts for its float or int8 weights; lookup copies what followed the same words earlier in the "
    "conversation (edits, rewrites, code); a draft model must have the model's tokenizer. Tokens by drafts, above "
    "the transcript, colours what was drafted and what the model corrected."
)
OWN_PRESET_ROLE = Qt.UserRole + 1  # a presets combo item's name when the preset is the person's own


class ModelListFetcher(QObject):
    """Fetches a server's model list on a thread of its own; `fetched` carries the cards or an error."""

    fetched = Signal(object)  # list of model cards, or the error's text

    def fetch(self, spec: RemoteSpec) -> None:
        def run():
            try:
                result = list_models(spec) or f"{spec.url} lists no models"
            except EngineError as e:
                result = str(e)
            try:
                self.fetched.emit(result)
            except RuntimeError:  # the dialog was closed meanwhile
                pass

        threading.Thread(target=run, name="kvchat-model-list", daemon=True).start()


def open_settings(directory: Path) -> QSettings:
    directory.mkdir(parents=True, exist_ok=True)
    return QSettings(str(directory / "settings.ini"), QSettings.IniFormat)


class SettingsDialog(QDialog):
    def __init__(self, settings: Settings, db_path: Path, parent=None):
        super().__init__(parent)
        self.setWindowTitle("kvchat settings")
        self.setObjectName("settingsDialog")
        outer = QVBoxLayout(self)
        self.tabs = QTabWidget()  # what this conversation uses, apart from what every conversation shares
        self.tabs.setObjectName("settingsTabs")
        outer.addWidget(self.tabs)
        engine_page, chat_page = QWidget(), QWidget()
        form = QFormLayout(engine_page)
        spec = settings.model
        self._original = settings
        self.backend = QComboBox()
        self.backend.setObjectName("backendCombo")
        self.backend.addItem("Local (this computer)", "local")
        self.backend.addItem("Remote (OpenAI-compatible server)", "remote")
        self.backend.setCurrentIndex(1 if settings.backend == "remote" else 0)
        form.addRow("Engine", self.backend)
        self.remoteUrl = QLineEdit(settings.remote_url)
        self.remoteUrl.setObjectName("remoteUrlEdit")
        self.remoteUrl.setPlaceholderText("http://localhost:8000/v1 (vLLM, SGLang, llama-server, Ollama, kvchat)")
        form.addRow("Server URL", self.remoteUrl)
        self.remoteKey = QLineEdit(settings.remote_api_key)
        self.remoteKey.setObjectName("remoteKeyEdit")
        self.remoteKey.setEchoMode(QLineEdit.Password)
        self.remoteKey.setPlaceholderText("none")
        form.addRow("API key", self.remoteKey)
        self.remoteModel = QComboBox()
        self.remoteModel.setObjectName("remoteModelCombo")
        self.remoteModel.setEditable(True)
        self.remoteModel.lineEdit().setPlaceholderText("the server's first model")
        self.remoteModel.setCurrentText(settings.remote_model)
        self.fetchModels = QPushButton("Fetch the list")
        self.fetchModels.setObjectName("fetchModelsButton")
        self.fetchModels.clicked.connect(self.fetch_models)
        self.remoteStatus = plain(QLabel(""))
        self.remoteStatus.setObjectName("remoteStatusLabel")
        self.remoteStatus.setWordWrap(True)
        row = QWidget()
        h = QHBoxLayout(row)
        h.setContentsMargins(0, 0, 0, 0)
        h.addWidget(self.remoteModel, 1)
        h.addWidget(self.fetchModels)
        form.addRow("Model on the server", row)
        form.addRow("", self.remoteStatus)
        self._remote_rows = (self.remoteUrl, self.remoteKey, row)
        self._fetcher = ModelListFetcher(self)
        self._fetcher.fetched.connect(self._models_fetched)
        self.backend.currentIndexChanged.connect(self._backend_changed)
        self.modelDir = QLineEdit(spec.path or "")
        self.modelDir.setObjectName("modelDirEdit")
        self.modelDir.setPlaceholderText("bundled demo model")
        self._folders = settings.model_folders
        browse = QPushButton("Folder…")
        browse.clicked.connect(self._browse)
        browse_file = QPushButton("GGUF file…")
        browse_file.clicked.connect(self._browse_file)
        row = QWidget()
        h = QHBoxLayout(row)
        h.setContentsMargins(0, 0, 0, 0)
        h.addWidget(self.modelDir)
        h.addWidget(browse)
        h.addWidget(browse_file)
        form.addRow("Model (folder or GGUF file)", row)
        self.device = QComboBox()
        self.device.setObjectName("deviceCombo")
        self.device.addItems(["auto", "cpu", "cuda", "mps"])
        self.device.setCurrentText(spec.device or "auto")
        form.addRow("Device", self.device)
        self.dtype = QComboBox()
        self.dtype.setObjectName("dtypeCombo")
        self.dtype.addItems(["auto", *DTYPES])
        self.dtype.setCurrentText(spec.dtype or "auto")
        form.addRow("dtype", self.dtype)
        self.capacity = self._spin(
            spec.capacity or 0, 0, 1 << 20, "capacitySpin", f"model default: min(context, {DEFAULT_CAPACITY:,})"
        )  # the engine's own default, the same as `engine serve` takes
        form.addRow("KV capacity (positions)", self.capacity)
        self.weights = self._combo(list(PRECISIONS), spec.weights, "weightsCombo")
        form.addRow("Weight precision", self.weights)
        self.kv = self._combo(list(PRECISIONS), spec.kv, "kvCombo")
        form.addRow("KV cache precision", self.kv)
        budget = -1 if spec.cache_budget is None else spec.cache_budget // 2**20
        self.cacheBudget = self._spin(budget, -1, 1 << 24, "cacheBudgetSpin", "automatic (¼ of free memory)")
        self.cacheBudget.setSuffix(" MiB")
        self.cacheBudget.setToolTip(
            "memory for the K/V of conversations you switched away from, shared by token prefixes; 0 keeps none"
        )
        form.addRow("Prefix store budget", self.cacheBudget)
        disk = -1 if spec.disk_budget is None else spec.disk_budget // 2**20
        self.diskBudget = self._spin(disk, -1, 1 << 24, "diskBudgetSpin", "automatic (4 GiB or ⅒ of free disk)")
        self.diskBudget.setSuffix(" MiB")
        self.diskBudget.setAccessibleName("Disk cache budget")
        self.diskBudget.setToolTip(
            "disk space for conversations' K/V, so that returning to one after a restart reads it instead of "
            "computing it again; 0 turns it off"
        )
        form.addRow("Disk cache budget", self.diskBudget)
        self.group = self._combo(["32", "64", "128", "0"], str(spec.group_size), "groupSizeCombo")
        self.group.setToolTip("values per quantization scale; 0 = one scale per output channel")
        form.addRow("Quantization group size", self.group)
        self.activations = self._combo(list(ACTIVATIONS), spec.activations, "activationsCombo")
        self.activations.setToolTip(
            "what quantized weights (int8/int4, a GGUF's codes) multiply: float32 is exact; int8 quantizes the "
            "activations per 32 values and uses integer dot products while decoding, and multiplies a prompt in "
            "bfloat16 where the CPU has it — faster (VNNI, bf16 instructions), an approximation, never on by "
            "itself (on the real SmolLM2 Q4_1 file the decoded top-1 token agrees at 98.3% of positions and "
            "perplexity rises 0.3%; a prompt's at 97.7%, perplexity within 0.1%)"
        )
        form.addRow("Activations (quantized weights)", self.activations)
        drafts_page = QWidget()
        self._drafting_rows(QFormLayout(drafts_page), settings)
        engine_form = form
        form = QFormLayout(chat_page)
        self.system = QPlainTextEdit(settings.system_prompt)
        self.system.setObjectName("systemPromptEdit")
        self.system.setMaximumHeight(70)
        self.presets = QComboBox()
        self.presets.setObjectName("systemPresetCombo")
        self.presets.setAccessibleName("System prompt presets")
        self.presets.activated.connect(self._preset_chosen)
        self._own_presets = settings.own_presets()
        self.savePreset = QPushButton("Save as preset…")
        self.savePreset.setObjectName("savePresetButton")
        self.savePreset.setAccessibleName("Save this system prompt as a preset")
        self.savePreset.clicked.connect(lambda: self.save_preset())
        self.deletePreset = QPushButton("Delete preset")
        self.deletePreset.setObjectName("deletePresetButton")
        self.deletePreset.setAccessibleName("Delete the chosen preset of yours")
        self.deletePreset.clicked.connect(lambda: self.delete_preset())
        self._fill_presets()
        row = QHBoxLayout()
        row.addWidget(self.presets, 1)
        row.addWidget(self.savePreset)
        row.addWidget(self.deletePreset)
        form.addRow("System prompt", row)
        form.addRow("", self.system)
        self.temperature = self._dspin(settings.temperature, 0, 5, 0.05, "temperatureSpin")
        form.addRow("Temperature (0 = greedy)", self.temperature)
        self.top_k = self._spin(settings.top_k, 0, 100000, "topKSpin", "off")
        form.addRow("Top-k", self.top_k)
        self.top_p = self._dspin(settings.top_p, 0.01, 1, 0.01, "topPSpin")
        form.addRow("Top-p", self.top_p)
        self.min_p = self._dspin(settings.min_p, 0, 1, 0.01, "minPSpin")
        form.addRow("Min-p", self.min_p)
        self.rep = self._dspin(settings.repetition_penalty, 0.5, 3, 0.05, "repetitionPenaltySpin")
        form.addRow("Repetition penalty", self.rep)
        self.max_new = self._spin(settings.max_new_tokens, 1, 1 << 16, "maxNewTokensSpin")
        form.addRow("Max new tokens", self.max_new)
        self.seed = self._spin(settings.seed, -1, 2**31 - 1, "seedSpin", "random")
        form.addRow("Seed", self.seed)
        self.overflow = QComboBox()
        self.overflow.setObjectName("overflowCombo")
        self.overflow.setAccessibleName("When the conversation outgrows the cache")
        for key, words in OVERFLOW_POLICIES.items():
            default = " (default)" if key == DEFAULT_OVERFLOW else ""
            self.overflow.addItem(f"{words[0].upper()}{words[1:]}{default}", key)
        self.overflow.setCurrentIndex(max(0, self.overflow.findData(settings.policy)))
        self.overflow.setToolTip(plain_tooltip(OVERFLOW_HELP))
        form.addRow("When the cache is full", self.overflow)
        settings_file = db_path.parent / "settings.ini"
        where = rich(
            QLabel(f"Conversations: {html.escape(str(db_path))}<br>Settings: {html.escape(str(settings_file))}")
        )
        where.setObjectName("dataPathLabel")
        where.setWordWrap(True)
        engine_form.addRow("Data", where)
        self.tabs.addTab(chat_page, "This conversation")
        self.replyFormat = ReplyFormatPage(settings)
        self.tabs.addTab(self.replyFormat, "Reply format")  # this conversation's too
        self.toolsPage = ToolsPage(settings)
        self.tabs.addTab(self.toolsPage, "Tools")  # the servers every conversation's; the tools on, this one's
        self.tabs.addTab(engine_page, "Engine (all conversations)")
        self.tabs.addTab(drafts_page, "Drafts (all conversations)")
        self._local_rows = (self.modelDir, browse, browse_file, self.device, self.dtype, self.capacity, self.weights)
        self._local_rows += (
            self.kv,
            self.cacheBudget,
            self.diskBudget,
            self.group,
            self.speculative,
            self.draftTokens,
        )  # the local engine's own: a server has its own
        self._backend_changed()
        buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        outer.addWidget(buttons)

    def _drafting_rows(self, form, settings: Settings) -> None:
        """Speculative decoding: off, the model itself in int4, lookup in the conversation, or a draft model's file
        or folder (engine.speculative); and the tokens a round drafts at most."""
        self.speculative = QComboBox()
        self.speculative.setObjectName("speculativeCombo")
        self.speculative.setAccessibleName("Speculative decoding")
        for words, key in DRAFT_CHOICES:
            self.speculative.addItem(words, key)
        chosen = settings.speculative if settings.speculative in ("", "int4", "lookup") else "model"
        self.speculative.setCurrentIndex(max(0, self.speculative.findData(chosen)))
        self.speculative.setToolTip(plain_tooltip(DRAFT_HELP))
        form.addRow("Speculative decoding", self.speculative)
        self.draftPath = QLineEdit(settings.speculative if chosen == "model" else "")
        self.draftPath.setObjectName("draftPathEdit")
        self.draftPath.setAccessibleName("Draft model (folder or GGUF file)")
        self.draftPath.setPlaceholderText("a smaller model with the same tokenizer: folder or GGUF file")
        choose = QPushButton("GGUF file…")
        choose.setAccessibleName("Choose the draft model's GGUF file")
        choose.clicked.connect(lambda: self._choose_file(self.draftPath, "Choose the draft model's GGUF file"))
        row = QWidget()
        h = QHBoxLayout(row)
        h.setContentsMargins(0, 0, 0, 0)
        h.addWidget(self.draftPath, 1)
        h.addWidget(choose)
        form.addRow("Draft model", row)
        self.draftTokens = self._spin(settings.draft_tokens, 1, MAX_TOKENS, "draftTokensSpin")
        self.draftTokens.setToolTip("tokens drafted a round at most: fewer while drafts are rejected")
        form.addRow("Draft tokens a round", self.draftTokens)
        said = plain(QLabel(DRAFT_HELP))
        said.setObjectName("draftHelpLabel")
        said.setWordWrap(True)
        form.addRow(said)

        def chosen_changed() -> None:
            self.draftPath.setEnabled(self.speculative.currentData() == "model")
            choose.setEnabled(self.draftPath.isEnabled())

        self.speculative.currentIndexChanged.connect(lambda _: chosen_changed())
        chosen_changed()

    def _drafting(self) -> str:
        """The settings' `speculative`: "", int4, lookup, or the draft model's path ("" where none is given)."""
        key = self.speculative.currentData()
        return self.draftPath.text().strip() if key == "model" else key

    @staticmethod
    def _combo(items, value, name):
        c = QComboBox()
        c.setObjectName(name)
        c.addItems(items)
        c.setCurrentText(value)
        return c

    @staticmethod
    def _spin(value, lo, hi, name, special=None):
        s = QSpinBox()
        s.setObjectName(name)
        s.setRange(lo, hi)
        if special:
            s.setSpecialValueText(special)
        s.setValue(value)
        return s

    @staticmethod
    def _dspin(value, lo, hi, step, name):
        s = QDoubleSpinBox()
        s.setObjectName(name)
        s.setRange(lo, hi)
        s.setSingleStep(step)
        s.setDecimals(2)
        s.setValue(value)
        return s

    def _browse(self):
        d = QFileDialog.getExistingDirectory(self, "Choose a Hugging Face model folder", self.modelDir.text())
        if d:
            self.modelDir.setText(d)

    def _browse_file(self):
        self._choose_file(self.modelDir, "Choose a GGUF model file")

    def _choose_file(self, edit: QLineEdit, title: str) -> None:
        path, _ = QFileDialog.getOpenFileName(self, title, edit.text(), "GGUF (*.gguf)")
        if path:
            edit.setText(path)

    def _fill_presets(self, current: str = "") -> None:
        """The built-in presets, then the person's own (marked as theirs), `current` chosen."""
        self.presets.clear()
        self.presets.addItem("Start from a preset…", "")
        for name, text in SYSTEM_PRESETS.items():
            self.presets.addItem(name, text)
        for name, text in sorted(self._own_presets.items(), key=lambda kv: kv[0].lower()):
            self.presets.addItem(f"{name} (yours)", text)
            self.presets.setItemData(self.presets.count() - 1, name, OWN_PRESET_ROLE)
        at = next((i for i in range(self.presets.count()) if self.presets.itemData(i, OWN_PRESET_ROLE) == current), 0)
        self.presets.setCurrentIndex(at)
        self.deletePreset.setEnabled(bool(current))

    def _preset_chosen(self, index: int) -> None:
        text = self.presets.itemData(index)
        if text:
            self.system.setPlainText(text)
        self.deletePreset.setEnabled(self.presets.itemData(index, OWN_PRESET_ROLE) is not None)

    def save_preset(self, name: str | None = None) -> None:
        """The system prompt in the box, kept under a name of the person's (asked for when not given);
        a name already theirs is replaced."""
        text = self.system.toPlainText().strip()
        if not text:
            QMessageBox.information(self, "Save as preset", "Write a system prompt first.")
            return
        if name is None:
            name, ok = QInputDialog.getText(self, "Save as preset", "Name of the preset:")
            if not ok:
                return
        name = " ".join(name.split())
        if not name:
            return
        if name in SYSTEM_PRESETS:
            QMessageBox.information(self, "Save as preset", f"“{name}” is a built-in preset: choose another name.")
            return
        self._own_presets[name] = text
        self._fill_presets(name)

    def delete_preset(self) -> None:
        name = self.presets.currentData(OWN_PRESET_ROLE)
        if name is not None:
            self._own_presets.pop(name, None)
            self._fill_presets()

    @property
    def is_remote(self) -> bool:
        return self.backend.currentData() == "remote"

    def _backend_changed(self, *_):
        for w in self._remote_rows:
            w.setEnabled(self.is_remote)
        for w in self._local_rows:
            w.setEnabled(not self.is_remote)

    def fetch_models(self) -> None:
        """The server's model list (GET /v1/models), fetched off the GUI thread."""
        self.remoteStatus.setText("asking the server…")
        self.fetchModels.setEnabled(False)
        self._fetcher.fetch(RemoteSpec(self.remoteUrl.text(), self.remoteKey.text()))

    def _models_fetched(self, result) -> None:
        self.fetchModels.setEnabled(True)
        if isinstance(result, str):
            self.remoteStatus.setText(result)
            return
        current = self.remoteModel.currentText()
        self.remoteModel.clear()
        self.remoteModel.addItems([c["id"] for c in result])
        self.remoteModel.setCurrentText(current if current in [c["id"] for c in result] else result[0]["id"])
        self.remoteStatus.setText(f"{len(result)} model{'s' if len(result) != 1 else ''} on the server")

    def result_settings(self) -> Settings:
        def auto(value):  # "auto", 0 and "" leave the choice to the engine
            return None if value in ("auto", "", 0) else value

        spec = LoadSpec(
            path=auto(self.modelDir.text().strip()),
            device=auto(self.device.currentText()),
            dtype=auto(self.dtype.currentText()),
            capacity=auto(self.capacity.value()),
            weights=self.weights.currentText(),
            kv=self.kv.currentText(),
            group_size=int(self.group.currentText()),
            activations=self.activations.currentText(),
            cache_budget=None if self.cacheBudget.value() < 0 else self.cacheBudget.value() * 2**20,
            disk_cache=self._original.model.disk_cache,
            disk_budget=None if self.diskBudget.value() < 0 else self.diskBudget.value() * 2**20,
        )
        return dataclasses.replace(
            self._original,
            model=spec,
            system_prompt=self.system.toPlainText().strip(),
            temperature=self.temperature.value(),
            top_k=self.top_k.value(),
            top_p=self.top_p.value(),
            min_p=self.min_p.value(),
            repetition_penalty=self.rep.value(),
            max_new_tokens=self.max_new.value(),
            seed=self.seed.value(),
            overflow=self.overflow.currentData(),
            model_folders=self._folders,
            backend=self.backend.currentData(),
            remote_url=self.remoteUrl.text().strip(),
            remote_api_key=self.remoteKey.text().strip(),
            remote_model=self.remoteModel.currentText().strip(),
            user_presets=json.dumps(self._own_presets, ensure_ascii=False) if self._own_presets else "",
            speculative=self._drafting(),
            draft_tokens=self.draftTokens.value(),
            reply_format=self.replyFormat.kind(),
            reply_grammar=self.replyFormat.text(),
            mcp_servers=self.toolsPage.servers_text(),
            tools=json.dumps(self.toolsPage.tool_keys()) if self.toolsPage.tool_keys() else "",
            tool_choice=self.toolsPage.tool_choice(),
        )

    def accept(self) -> None:
        """OK: kept unless the reply format's schema or grammar does not compile (its tab shown, saying why)."""
        if self.replyFormat.problem():
            self.tabs.setCurrentWidget(self.replyFormat)
            self.replyFormat.show_check()
            return
        if self.toolsPage.problem():  # the servers' text does not read: its tab shown, saying why
            self.tabs.setCurrentWidget(self.toolsPage)
            return
        super().accept()

    def done(self, result: int) -> None:
        self.toolsPage.close_host()  # servers started to list their tools stop with the dialog
        super().done(result)
