"""A reply cut into the pieces the transcript draws differently: Markdown text, fenced code blocks and
`<think>` blocks. No Qt here. While a reply streams only its last piece is still open; the ones
before it never change again (but the growing paragraph's complete lines), so the view renders each
of them once.

Text is cut at blank lines (outside code and thinking), and while a reply streams its last paragraph is
cut before the line still being written: the open piece is one line, not the whole reply, and the
paragraph's complete lines (a list's items, a table's rows) are drawn as Markdown as they arrive.
"""

from __future__ import annotations

import dataclasses
import re

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class Piece:
    kind: str  # text | code | think
    text: str  # Markdown (text), the code itself (code), what the model thought (think)
    lang: str = ""  # the fence's language, for code
    closed: bool = True  # False: the last piece of a reply still streaming (no end seen yet)


def pieces(reply: str, streaming: bool = False, thinking: bool = True) -> list[Piece]:
    """The reply's pieces in order. With `streaming`, the last piece is open unless its end was seen;
    without `thinking`, `<think>` is text like any other (what a person typed)."""
    out: list[Piece] = []
    lines = reply.split("\n")
    text: list[str] = []

    def flush_text(closed: bool = True) -> None:
        body = "\n".join(text).strip("\n")
        if body.strip():
            out.append(Piece("text", body, closed=closed))
        text.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        fence = FENCE.match(line)
        if fence:
            flush_text()
            mark, lang = fence.group(1), fence.group(2)
            body, j, closed = [], i + 1, False
            while j < len(lines):
                end = lines[j].strip()
                if end.startswith(mark[0] * len(mark)) and not end.strip(mark[0]):
                    closed = True
                    break
                body.append(lines[j])
                j += 1
            if streaming and not closed and body and _fence_arriving(body[-1], mark):
                body.pop()  # the closing fence half streamed ("`", "``"): not a line of the code
            out.append(Piece("code", "\n".join(body), lang, closed or not streaming))
            i = j + 1
            continue
        if thinking and stripped.startswith(THINK_OPEN):
            flush_text()
            rest = "\n".join(lines[i:])
            start = rest.index(THINK_OPEN) + len(THINK_OPEN)
            end = rest.find(THINK_CLOSE, start)
            if end < 0:  # still thinking (or never closed): everything after is the thought
                out.append(Piece("think", rest[start:].strip("\n"), closed=not streaming))
                return out
            out.append(Piece("think", rest[start:end].strip("\n")))
            after = rest[end + len(THINK_CLOSE) :]
            lines = after.split("\n")
            i = 0
            continue
        if not stripped:
            flush_text()
        else:
            text.append(line)
        i += 1
    if streaming and len(text) > 1 and not reply.endswith("\n\n"):  # the growing paragraph's complete lines
        last = text.pop()  # are Markdown already (a list's items are bullets as they come): only the line
        flush_text()  # still being written is open
        text.append(last)
    flush_text(closed=not streaming or reply.endswith("\n\n"))
    return out


def _fence_arriving(line: str, mark: str) -> bool:
    """Whether the line still being written could be the start of the block's closing fence: up to 3 spaces,
    then fewer of the fence's character than the fence has, and nothing else yet."""
    body = line.lstrip(" ")
    return len(line) - len(body) <= 3 and 0 < len(body) < len(mark) and not body.strip(mark[0])


def code_blocks(reply: str) -> list[str]:
    """The code of each fenced block, in order (what each block's Copy button copies)."""
    return [p.text for p in pieces(reply) if p.kind == "code"]
