"""Tools in the app, through the real window: an MCP server written with the SDK (tests/mcp_standin.py, stdio), its
tool offered to a tiny random model whose chat template takes tools (Qwen 2.5's), a call required so the random
model makes one. The call is shown and runs only once allowed; its result is in the transcript, folded; the next
reply goes on from it with every earlier position kept; a denied call never runs; a server that hangs or exits is
an error in the transcript and the chat goes on; a 50 MB result is cut."""

import json
import sys
from pathlib import Path

import pytest
from gui import panel
from PySide6.QtCore import Qt
from tool_templates import HERMES

STANDIN = Path(__file__).parent.parent / "mcp_standin.py"


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    from checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tools"), "llama", chat_template=HERMES, generation_eos=[1],
                           max_position_embeddings=2048)  # the tools' text in the prompt: ~400 tokens  # fmt: skip


def _servers(mark: Path) -> str:
    return json.dumps({"mcpServers": {"standin": {"command": sys.executable, "args": [str(STANDIN), str(mark)]}}})


def _open(make_window, tool_model, tmp_path, tools, **settings):
    return make_window(tool_model, mcp_servers=_servers(tmp_path / "ran.txt"), tools=json.dumps(tools),
                       tool_choice="required", max_new_tokens=160, **settings)  # fmt: skip


def _ask(qtbot, w, spin_loop, text, answer=None, replies=2, timeout=120):
    """Send `text`; answer the call's question with the button `answer` (None: no question expected); wait for
    `replies` replies to end and return their last events."""
    got = []
    w.replyFinished.connect(got.append)
    qtbot.keyClicks(w.composer, text)
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    if answer is not None:
        spin_loop(lambda: w.approval is not None and w.approval.isVisible() or len(got) > 1, timeout)
        assert len(got) == 1 and got[0].tool_calls, "the reply went on before the call was answered"
        assert json.loads(w.approval.arguments.toPlainText()) == json.loads(got[0].tool_calls[0].arguments)
        qtbot.mouseClick(getattr(w.approval, answer), Qt.LeftButton)
    spin_loop(lambda: len(got) >= replies, timeout)
    w.replyFinished.disconnect(got.append)
    return got


def _result_view(w):
    views = [v for v in w.transcript.views if v.message.role == "tool"]
    assert views, [v.message.role for v in w.transcript.views]
    return views[-1]


def test_an_allowed_call_runs_and_the_next_reply_goes_on_from_its_result(qtbot, make_window, spin_loop, tool_model,
                                                                         tmp_path):  # fmt: skip
    w = _open(make_window, tool_model, tmp_path, ["standin/get_weather"])
    first, second = _ask(qtbot, w, spin_loop, "What is the weather in Paris?", answer="allowOnce")
    assert first.tool_calls and first.tool_calls[0].name == "get_weather"
    roles = [v.message.role for v in w.transcript.views]
    assert roles == ["user", "assistant", "tool", "assistant"], roles
    call_view = w.transcript.views[1]
    assert call_view.toolBlock is not None and call_view.toolBlock.objectName() == "toolCalls"
    city = json.loads(first.tool_calls[0].arguments)["city"]
    assert (tmp_path / "ran.txt").read_text() == city  # it ran, with the model's arguments
    result = _result_view(w)
    assert result.toolBlock.toggle.text().startswith("get_weather · standin · allowed once · ")
    assert not result.toolBlock.body.isVisible()  # folded until opened
    qtbot.mouseClick(result.toolBlock.toggle, Qt.LeftButton)
    assert result.toolBlock.body.isVisible() and "21 C, clear sky" in result.toolBlock.body.toPlainText()
    # the next reply: every position before the result kept (the prompt, and the call as the reply made it)
    before = first.trace["prompt_tokens"] + len(first.token_ids)
    reused = second.reuse.reused
    assert reused >= before - 1, (reused, before)  # all but the reply's end token, which the template rewrites
    assert panel(w, "reusedValue") == f"{reused:,}"
    assert int(panel(w, "recomputedValue").replace(",", "")) == second.trace["prompt_tokens"] - reused
    bands = {role for _, _, role in w.chat.lane_maps.shown.roles()}
    assert {"call", "tool", "user", "reply"} <= bands, bands  # the map gives the call and the result bands of their own
    print(f"tool loop: reused {reused} of {before} positions; computed {second.trace['prompt_tokens'] - reused}")


def test_a_denied_call_never_runs_and_the_reply_is_told(qtbot, make_window, spin_loop, tool_model, tmp_path):
    w = _open(make_window, tool_model, tmp_path, ["standin/get_weather"])
    _ask(qtbot, w, spin_loop, "What is the weather in Rome?", answer="deny")
    assert not (tmp_path / "ran.txt").exists()
    result = _result_view(w)
    assert result.message.content == "The person did not allow this call."
    assert "denied" in result.toolBlock.toggle.text()


def test_a_server_that_hangs_times_out_one_that_exits_is_an_error_and_the_chat_goes_on(qtbot, make_window, spin_loop,
                                                                                      tool_model, tmp_path,
                                                                                      monkeypatch):  # fmt: skip
    import desktop.core.tool_host as tool_host

    monkeypatch.setattr(tool_host, "CALL_S", 2.0)
    w = _open(make_window, tool_model, tmp_path, ["standin/hang"])
    _ask(qtbot, w, spin_loop, "Wait for it.", answer="allowOnce")
    result = _result_view(w)
    assert result.message.content == "standin did not answer within 2 s"
    assert "failed" in result.toolBlock.toggle.text()
    # the same server, its other tool: the server exits mid-call; the reply goes on, and so does the chat
    conv = w.store.conversation(w.chat.current_cid)
    w.chat.guard(w.store.set_settings, conv.id, {**conv.settings, "tools": json.dumps(["standin/crash"])})
    _ask(qtbot, w, spin_loop, "Now crash.", answer="allowAlways")
    result = _result_view(w)
    assert result.message.content.startswith("standin exited with status 3"), result.message.content
    assert "exiting on purpose" in result.message.content
    assert not w.chat.generating and w.sendButton.isEnabled()
    # allowed in this conversation: kept with it (a restart asks no more), not carried by its export
    assert w.store.conversation(conv.id).settings["tools_allowed"] == ["standin/crash"]
    w.chat.tools_allowed.clear()
    _ask(qtbot, w, spin_loop, "Again.", answer=None)  # no question: the server, started again, exits again
    assert _result_view(w).message.content.startswith("standin exited with status 3")
    from desktop.core.exchange import to_json

    assert "tools_allowed" not in (to_json(w.store, conv.id)["settings"] or {})


def test_a_50_mb_result_is_cut(qtbot, make_window, spin_loop, tool_model, tmp_path):
    w = _open(make_window, tool_model, tmp_path, ["standin/big"])
    _ask(qtbot, w, spin_loop, "Fetch it all.", answer="allowOnce")
    result = _result_view(w)
    assert len(result.message.content) < 33_000 and result.message.content.startswith("xxxx")
    assert "cut" in result.toolBlock.toggle.text() and "MB" in result.toolBlock.toggle.text()


def test_the_tools_tab_checks_the_servers_as_typed_and_lists_their_tools(qtbot, tmp_path, loop, spin_loop):
    """Settings → Tools: a configuration that does not read keeps OK from closing, saying why; one imported from a
    file other apps write is taken; List their tools starts the servers and lists each tool with its description;
    the ticked ones and the call rule are the conversation's."""
    from desktop.core.settings import Settings
    from desktop.settings_dialog import SettingsDialog

    dlg = SettingsDialog(Settings(), tmp_path / "kvchat.db")
    qtbot.addWidget(dlg)
    page = dlg.toolsPage
    assert dlg.tabs.tabText(dlg.tabs.indexOf(page)) == "Tools"
    qtbot.keyClicks(page.servers, '{"mcpServers": {"a": {"url": "file:///etc"}}}')
    assert "http:// or https://" in page.status.text()
    dlg.accept()
    assert dlg.result() != dlg.DialogCode.Accepted
    assert dlg.tabs.currentWidget() is page  # OK refused: the tab shown, saying why
    config = tmp_path / "claude_desktop_config.json"
    config.write_text(_servers(tmp_path / "ran.txt"))
    from PySide6.QtWidgets import QFileDialog

    original = QFileDialog.getOpenFileName
    QFileDialog.getOpenFileName = staticmethod(lambda *a, **k: (str(config), "JSON (*.json)"))
    try:
        qtbot.mouseClick(page.importButton, Qt.LeftButton)
    finally:
        QFileDialog.getOpenFileName = original
    assert page.problem() == "" and "standin:" in page.status.text()
    qtbot.mouseClick(page.listButton, Qt.LeftButton)
    spin_loop(lambda: page.listButton.isEnabled() and page.tools.count() >= 4, 60)
    items = {page.tools.item(i).data(Qt.UserRole): page.tools.item(i) for i in range(page.tools.count())}
    assert "The weather in a city now." in items["standin/get_weather"].text()
    items["standin/get_weather"].setCheckState(Qt.Checked)
    page.choice.setCurrentIndex(page.choice.findData("required"))
    got = dlg.result_settings()
    assert json.loads(got.tools) == ["standin/get_weather"] and got.tool_choice == "required"
    assert set(got.tool_servers()) == {"standin"} and "1 tool, a call required" in got.conversation_summary()


def test_stop_while_a_call_waits_runs_nothing_and_ends_the_loop(qtbot, make_window, spin_loop, tool_model, tmp_path):
    w = _open(make_window, tool_model, tmp_path, ["standin/get_weather"])
    got = []
    w.replyFinished.connect(got.append)
    qtbot.keyClicks(w.composer, "Weather in Lima?")
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: w.approval is not None and w.approval.isVisible(), 120)
    assert w.chat.generating and w.stopButton.isVisible()  # the loop holds the conversation while it asks
    qtbot.mouseClick(w.stopButton, Qt.LeftButton)
    spin_loop(lambda: not w.chat.generating, 30)
    assert not w.approval.isVisible() and len(got) == 1  # the question gone, no reply after it
    assert not (tmp_path / "ran.txt").exists()
    result = _result_view(w)
    assert result.message.content == "The person stopped the reply before this call ran."
    assert "not run: stopped" in result.toolBlock.toggle.text() and w.sendButton.isEnabled()


def test_tools_are_not_offered_to_a_model_whose_template_takes_none(qtbot, make_window, spin_loop, tmp_path):
    """The demo model's template has no tools: its replies run without them (never failing for it), the summary
    line says the tools are off and why, and no server is started."""
    from gui import send

    w = make_window(None, mcp_servers=_servers(tmp_path / "ran.txt"), tools=json.dumps(["standin/get_weather"]),
                    tool_choice="required", max_new_tokens=8)  # fmt: skip
    assert w.facts["tool_format"] is None and not w.chat.model_takes_tools()
    last = send(qtbot, w, spin_loop, "Weather?")
    assert type(last).__name__ == "Finished" and not last.tool_calls
    assert "1 tool, a call required (off: this model's chat template takes no tools)" in (
        w.conversationSettingsLabel.text())  # said beside the tools  # fmt: skip
    assert w.chat.tool_listing == {} and w.chat.tool_host._live == {}  # nothing started
