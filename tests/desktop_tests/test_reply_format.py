"""A conversation's reply format in the real window: a JSON schema typed into Settings → Reply format (checked as
it is typed, OK refused while it does not compile), the reply that follows validates, each token's tooltip says
what the grammar did there, the panel's Structured output rows sum the reply, and another conversation keeps
plain text."""

import html
import json

import jsonschema
from gui import panel, send
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialog

from desktop.reply_format_page import CHECK_DELAY_MS
from desktop.settings_dialog import SettingsDialog
from desktop.token_view import BINS, bin_of, grammar_kind

SCHEMA = {"title": "trip", "type": "object", "additionalProperties": False, "required": ["city", "nights"],
          "properties": {"city": {"type": "string", "maxLength": 16},
                         "nights": {"type": "integer", "minimum": 1, "maximum": 9}}}  # fmt: skip


def test_a_schema_set_for_a_conversation_shapes_its_replies_and_the_panel_says_how(qtbot, make_window, spin_loop,
                                                                                    demo_model_dir):  # fmt: skip
    w = make_window(demo_model_dir, max_new_tokens=80)
    qtbot.mouseClick(w.newButton, Qt.LeftButton)
    plain_cid = w.chat.current_cid
    qtbot.mouseClick(w.newButton, Qt.LeftButton)
    dlg = SettingsDialog(w.chat.settings_for(), w.db_path, w)
    qtbot.addWidget(dlg)
    page = dlg.replyFormat
    dlg.tabs.setCurrentWidget(page)  # the tab, as a click on it shows it
    assert not page.source.isVisibleTo(dlg)  # text: nothing to write
    page.format.setCurrentIndex(page.format.findData("json_schema"))
    assert page.source.isVisibleTo(dlg) and "write the schema" in page.status.text()
    qtbot.keyClicks(page.source, '{"type": "nonsense"}')
    qtbot.waitUntil(lambda: "does not compile" in page.status.text(), timeout=CHECK_DELAY_MS * 10)
    assert "Invalid type: nonsense" in page.status.text()
    dlg.accept()  # refused: the tab says why
    assert dlg.result() != QDialog.Accepted and dlg.tabs.currentWidget() is page
    page.source.setPlainText(json.dumps(SCHEMA))
    qtbot.waitUntil(lambda: page.status.text() == "✓ JSON schema “trip”: compiles", timeout=CHECK_DELAY_MS * 10)
    dlg.accept()
    assert dlg.result() == QDialog.Accepted
    w.apply_settings(dlg.result_settings(), conversation=True)
    assert "replies: JSON schema “trip”" in w.conversationSettingsLabel.text()

    final = send(qtbot, w, spin_loop, "Plan a trip")
    jsonschema.validate(json.loads(final.text), SCHEMA)  # the demo model's reply, made to validate
    g = final.trace["grammar"]
    assert final.reason in ("grammar", "eos") and g["steps"] == len(final.token_ids)
    assert panel(w, "grammarValue") == "JSON schema “trip”"
    assert panel(w, "removedValue") == f"{g['mean_removed']:.1%} of the model's probability a step (mean)"
    forbidden = f"{g['overridden']:,} of {g['steps']:,} steps: the model's first choice forbidden"
    assert panel(w, "overriddenValue") == forbidden
    assert panel(w, "maskTimeValue").endswith("µs waited for")
    reply = w.transcript.views[1]
    kept = reply.message.trace["tokens"]  # stored with the reply: each token's grammar figures
    assert len(kept) == g["steps"] and all(1 <= t["grammar"]["allowed"] <= t["grammar"]["vocab"] for t in kept)
    w.tokenColours.setCurrentIndex(w.tokenColours.findData("probability"))
    view = reply.tokenView
    forced = next((i for i, t in enumerate(kept) if t["grammar"]["preferred_text"] is not None), None)
    first = html.unescape(view.details(0))  # the tooltip's text
    assert f"Grammar: {kept[0]['grammar']['allowed']:,} of {kept[0]['grammar']['vocab']:,} tokens allowed" in first
    if forced is not None:
        assert f"the model preferred {kept[forced]['grammar']['preferred_text']!r}: the grammar forbade it" in (
            html.unescape(view.details(forced)))  # fmt: skip

    w.tokenColours.setCurrentIndex(w.tokenColours.findData("grammar"))  # Tokens by grammar: what it did at each
    assert "the only one allowed" in w.tokenLegend.accessibleDescription()
    kinds = [grammar_kind(t["grammar"]) for t in kept]
    assert "forced" in kinds  # a JSON schema's punctuation and keys: the one token allowed
    view = reply.tokenView
    for k, i in enumerate(view.at):
        cursor = view.textCursor()
        cursor.setPosition(view.starts[k] + 1)
        brush = cursor.charFormat().background()
        want = BINS["grammar"][bin_of(kept[i], "grammar")][1]
        assert (brush.color().name() if brush.style() != Qt.NoBrush else None) == want, (i, kept[i]["grammar"])
    print("tokens by grammar:", {kind: kinds.count(kind) for kind in set(kinds)})

    w.select_conversation(plain_cid)  # the other conversation: plain text, as before
    assert w.chat.settings_for().grammar() is None and "replies:" not in w.conversationSettingsLabel.text()
    final = send(qtbot, w, spin_loop, "Plan a trip")
    assert final.trace["grammar"] is None and panel(w, "grammarValue") == "none (Settings → Reply format)"


def test_a_grammar_file_opens_into_the_tab_and_a_bad_one_is_said(qtbot, make_window, demo_model_dir, tmp_path):
    w = make_window(demo_model_dir)
    dlg = SettingsDialog(w.chat.settings_for(), w.db_path, w)
    qtbot.addWidget(dlg)
    page = dlg.replyFormat
    gbnf = tmp_path / "yes.gbnf"
    gbnf.write_text('root ::= "yes" | "no"\n')
    page.load(gbnf)
    assert page.kind() == "gbnf" and page.text() == 'root ::= "yes" | "no"\n'
    assert page.status.text() == "✓ GBNF grammar (1 line): compiles"
    big = tmp_path / "big.lark"
    big.write_text("x" * (2 << 20))
    page.load(big)
    assert "larger than" in page.status.text() and page.kind() == "gbnf"  # nothing half-loaded


def test_an_imported_reply_format_is_kept_only_whole():
    """An import's conversation settings keep a reply format only with a schema or grammar that is one (its size
    checked); the rest of the settings stay."""
    from desktop.core.exchange import conversation_settings

    good = {"reply_format": "json_schema", "reply_grammar": json.dumps(SCHEMA), "temperature": 0.5}
    assert conversation_settings(good) == good
    for bad in ({"reply_format": "json_schema", "reply_grammar": "not json"},
                {"reply_format": "lark", "reply_grammar": "x" * (2 << 20)},
                {"reply_format": "json_schema", "reply_grammar": "[1, 2]"}, {"reply_format": "python"}):  # fmt: skip
        assert conversation_settings({**bad, "temperature": 0.5}) == {"temperature": 0.5}
