"""Text the app did not write — a model's reply, an import, a server's error, a file's name — shown as text:
Markdown rendered without loading anything it names, labels that never guess rich text, links opened only
when they are web links and the person agreed, and limits past which Markdown is shown plain."""

from __future__ import annotations

import html
import re

from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QDesktopServices, QTextCharFormat, QTextCursor, QTextDocument, QTextFormat
from PySide6.QtWidgets import QLabel, QMessageBox, QWidget

MARKDOWN_CHARS = 20_000  # a piece longer than this is shown as plain text
MARKDOWN_LINES = 400  # so is one of more lines
MARKDOWN_TABLE_ROWS = 100  # or with a table of more rows (a label lays a table out at about 2 ms a row)
MARKDOWN_DEPTH = 12  # or nested deeper (quotes, lists): each level is a frame Qt lays out again
WEB_SCHEMES = ("http", "https", "mailto")  # what a link may hand to the system's opener
MESSAGE_WORD = 30  # characters: a message's word longer than this may wrap inside (it never widens the transcript)
BREAK = "\u200b"  # a zero-width space: where a label may wrap a long word

# What a tag in a document's HTML may still name that a label would load: a background (an attribute, CSS).
TAG = re.compile(r"<[^>]*>")
LOADS = re.compile(r"""\sbackground\s*=\s*("[^"]*"|'[^']*'|[^\s>]+)|background-image\s*:\s*url\([^)]*\)\s*;?""", re.I)
DEPTH = re.compile(r"^((?: {0,3}>)+|(?:\s*(?:[-*+]|\d+[.)])\s)+)")


class _NoResources(QTextDocument):
    """A document that loads nothing: an image, a stylesheet or a background it names stays unloaded."""

    def loadResource(self, kind, url):
        return None


def _depth(lead: str) -> int:
    """How deep a line's start nests: a level per quote mark, per list marker, per two spaces of indent."""
    indent = len(lead) - len(lead.lstrip(" "))
    return lead.count(">") + len(re.findall(r"(?:[-*+]|\d+[.)])\s", lead)) + indent // 2


def too_big_for_markdown(text: str) -> str | None:
    """Why a piece is shown as plain text instead of Markdown, or None when it is drawn as Markdown."""
    lines = text.split("\n")
    rows = sum(1 for line in lines if line.lstrip().startswith("|"))
    if rows > MARKDOWN_TABLE_ROWS:
        return f"a table of {rows:,} lines is past what the window draws as Markdown ({MARKDOWN_TABLE_ROWS:,})"
    if len(lines) > MARKDOWN_LINES:
        return f"{len(lines):,} lines is past what the window draws as Markdown ({MARKDOWN_LINES:,})"
    if len(text) > MARKDOWN_CHARS:
        return f"{len(text):,} characters is past what the window draws as Markdown ({MARKDOWN_CHARS:,})"
    for line in lines:
        m = DEPTH.match(line)
        if m and _depth(m.group(0)) > MARKDOWN_DEPTH:
            return f"it nests deeper than the window draws as Markdown ({MARKDOWN_DEPTH} levels)"
    return None


def breakable(text: str, longest: int) -> str:
    """`text` with places to wrap inside its words longer than `longest` characters (a path, a model id, a
    run of digits): after each separator, and every `longest` characters where there is none. A label
    cannot break a word, so one long word would set the width of the whole column it sits in."""
    if len(text) <= longest or not any(len(w) > longest for w in text.split()):
        return text

    def soften(word: str) -> str:
        if len(word) <= longest:
            return word
        word = re.sub(r"([/\\_.,:=-])(?=.)", r"\1" + BREAK, word)
        return BREAK.join(re.sub(f"(.{{{longest}}})(?=.)", r"\1" + BREAK, piece) for piece in word.split(BREAK))

    return re.sub(r"\S+", lambda m: soften(m.group(0)), text)


def markdown_html(text: str) -> str:
    """Markdown as HTML that loads nothing: images become their alt text (`[image: alt]`), backgrounds are
    dropped, the document's own font is left to the label. Links stay links (open_link decides on a click)."""
    doc = _NoResources()
    doc.setMarkdown(text)
    changes = []  # (position, length, the text in its place, its format): images and long words
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            if frag.isValid() and frag.charFormat().isImageFormat():
                alt = frag.charFormat().property(QTextFormat.Property.ImageAltText) or ""
                changes.append((frag.position(), frag.length(), f"[image: {alt}]" if alt else "[image]", None))
            elif frag.isValid() and (soft := breakable(frag.text(), MESSAGE_WORD)) != frag.text():
                changes.append((frag.position(), frag.length(), soft, frag.charFormat()))  # a link keeps its href
            it += 1
        block = block.next()
    for pos, n, replacement, fmt in reversed(changes):
        cursor = QTextCursor(doc)
        cursor.setPosition(pos)
        cursor.setPosition(pos + n, QTextCursor.KeepAnchor)
        cursor.insertText(replacement, QTextCharFormat() if fmt is None else fmt)
    out = doc.toHtml()
    out = re.sub(r"<body style=\"[^\"]*\">", "<body>", out, count=1)  # the label's font, not the document's
    return TAG.sub(lambda m: LOADS.sub("", m.group(0)).replace("<img", "<span"), out)


def plain(label: QLabel) -> QLabel:
    """A label that shows its text as text, whatever it holds (`<img src=…>` is characters, never an image)."""
    label.setTextFormat(Qt.PlainText)
    return label


def rich(label: QLabel) -> QLabel:
    """A label of the app's own rich text (bold, line breaks), anything outside in it escaped by the caller."""
    label.setTextFormat(Qt.RichText)
    return label


def warn(parent: QWidget | None, title: str, text: str) -> None:
    """A warning whose text is shown as text (QMessageBox's static warning guesses rich text)."""
    box = QMessageBox(QMessageBox.Warning, title, text, QMessageBox.Ok, parent)
    box.setTextFormat(Qt.PlainText)
    box.exec()


def plain_tooltip(text: str) -> str:
    """A tooltip of outside text: tooltips guess rich text, so it is escaped inside a paragraph of its own."""
    return f"<p style='white-space:pre-wrap'>{html.escape(text)}</p>"


def is_web_link(href: str) -> bool:
    url = QUrl(href)
    scheme = url.scheme().lower()
    return url.isValid() and scheme in WEB_SCHEMES and (scheme == "mailto" or bool(url.host()))


def open_link(parent: QWidget | None, href: str) -> bool:
    """A link clicked in a message: a web link opens in the system's browser after the person sees the
    whole address and agrees; anything else (a file, a share, a script, a relative path) is shown, never
    opened. True when it was handed to the browser."""
    box = QMessageBox(parent)
    box.setTextFormat(Qt.PlainText)
    box.setObjectName("linkDialog")
    if not is_web_link(href):
        box.setIcon(QMessageBox.Warning)
        box.setWindowTitle("Link not opened")
        box.setText(f"kvchat opens only web links (http, https, mailto). This link was not opened:\n\n{href}")
        box.setStandardButtons(QMessageBox.Ok)
        box.exec()
        return False
    url = QUrl(href)
    box.setIcon(QMessageBox.Question)
    box.setWindowTitle("Open link?")
    shown = bytes(url.toEncoded()).decode()  # the address as sent: a look-alike host shows as xn--…
    box.setText(f"Open this address in your browser?\n\n{shown}")
    box.setStandardButtons(QMessageBox.Open | QMessageBox.Cancel)
    box.setDefaultButton(QMessageBox.Cancel)
    if box.exec() != QMessageBox.Open:
        return False
    return QDesktopServices.openUrl(url)
