"""Imports with big records in the real window: a 10 MB message and a reply of 65,536 token records are drawn
a page at a time, and the records are read and checked off the GUI thread (the probe froze it for minutes)."""

import json
import threading

from PySide6.QtCore import Qt

import desktop.core.records as records
from desktop.reply_widgets import PLAIN_CHARS, PLAIN_WHOLE, PlainBlock
from desktop.token_view import TOKEN_PAGE

TOP = [{"text": "a", "logprob": -0.1}, {"text": "c", "logprob": -3.0}]
STEP = {"shown": "ab ", "token_id": 5, "text": "ab ", "logprob": -0.7, "sampled_logprob": -0.1, "entropy": 1.3,
        "sampled_entropy": 0.0, "rank": 1, "top": TOP}  # fmt: skip


def _import(qtbot, w, tmp_path, messages) -> int:
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"format": "kvchat-conversation", "version": 1, "title": "big", "messages": messages}))
    w.import_conversation(str(path))
    qtbot.waitUntil(lambda: w.importing is None, timeout=120000)
    return w.chat.current_cid


def test_a_reply_of_65536_tokens_is_checked_off_the_gui_thread_and_coloured_a_page_at_a_time(
    qtbot, make_window, demo_model_dir, tmp_path, monkeypatch
):
    checked_on = []  # the threads a record of many tokens was checked on
    clean = records.clean_record

    def watched(record):
        if isinstance(record, dict) and len(record.get("tokens") or ()) > 1000:
            checked_on.append(threading.current_thread().name)
        return clean(record)

    monkeypatch.setattr(records, "clean_record", watched)  # the store's reads (records.read_record)
    monkeypatch.setattr("desktop.core.exchange.clean_record", watched)  # and the import's
    n = records.MAX_TOKENS
    reply = {"id": 1, "parent_id": 0, "role": "assistant", "content": "ab " * n, "trace": {"tokens": [STEP] * n}}
    msgs = [{"id": 0, "role": "user", "content": "Count."}, reply]
    w = make_window(demo_model_dir)
    w.tokenColours.setCurrentIndex(1)  # tokens by probability
    cid = _import(qtbot, w, tmp_path, msgs)
    qtbot.waitUntil(lambda: w.store.kept(cid) and w.transcript.views[-1].tokenView is not None, timeout=60000)
    assert checked_on and threading.main_thread().name not in checked_on  # the import's and the branch's reads
    view = w.transcript.views[-1]
    tokens = view.tokenView
    assert tokens.drawn == TOKEN_PAGE and tokens.toPlainText() == "ab " * TOKEN_PAGE
    assert view.tokenMore.isVisible()
    assert view.tokenMore.text() == f"Show {TOKEN_PAGE:,} more tokens ({TOKEN_PAGE:,} of {n:,} shown)"
    qtbot.mouseClick(view.tokenMore, Qt.LeftButton)
    assert tokens.drawn == 2 * TOKEN_PAGE and len(tokens.toPlainText()) == 3 * 2 * TOKEN_PAGE
    tokens.move_to(2 * TOKEN_PAGE - 1)  # the last token drawn: Right draws the next page and goes on to it
    qtbot.keyClick(tokens, Qt.Key_Right)
    assert tokens.current == 2 * TOKEN_PAGE and tokens.drawn == 3 * TOKEN_PAGE
    assert view.forkRow.isVisible() and "Token 10,001" not in view.forkRow.label.text()  # its own words
    assert f"Token {2 * TOKEN_PAGE + 1} " in view.forkRow.label.text()
    w.select_message(view.message.id)
    assert len(w.chat.stats.steps) == n  # the panel has them all
    checked_on.clear()
    w.select_conversation(cid)  # read again: kept by the store, not checked again
    assert checked_on == []


def test_a_10_mb_message_on_one_line_is_plain_text_a_page_of_characters_at_a_time(
    qtbot, make_window, demo_model_dir, tmp_path
):
    line = "word " * 2_000_000  # 10 MB, no newline: paging by lines alone drew all of it
    msgs = [{"id": 0, "role": "user", "content": line},
            {"id": 1, "parent_id": 0, "role": "assistant", "content": "a\n" + line}]  # fmt: skip
    w = make_window(demo_model_dir)
    _import(qtbot, w, tmp_path, msgs)
    qtbot.waitUntil(lambda: len(w.transcript.views) == 2, timeout=60000)
    for view in w.transcript.views:
        block = view.findChild(PlainBlock)
        assert block is not None and f"past what the window draws as Markdown ({PLAIN_WHOLE:,})" in block.note.text()
        shown = block.view.toPlainText()
        assert len(shown) == PLAIN_CHARS and view.message.content.startswith(shown)
        assert block.moreButton.isVisible() and "characters not shown" in block.moreButton.text()
    block = w.transcript.views[1].findChild(PlainBlock)
    qtbot.mouseClick(block.moreButton, Qt.LeftButton)
    assert block.view.toPlainText() == ("a\n" + line)[: block.end] and block.end == 2 * PLAIN_CHARS
    w.tokenColours.setCurrentIndex(1)  # no tokens kept: the views are not drawn again
    assert w.transcript.views[1].findChild(PlainBlock) is block and block.end == 2 * PLAIN_CHARS
