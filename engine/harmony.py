"""The harmony format (gpt-oss): a reply is messages on channels — `<|channel|>analysis<|message|>…<|end|>` the
model's reasoning, `<|start|>assistant<|channel|>final<|message|>…` its answer. Its text as kvchat shows every
reasoning model's: the analysis channel as a `<think>` block (the app folds it under "Thinking" and counts its tokens
apart), the final channel as the reply, the markers and headers dropped, a message to a function (`to=functions.NAME`)
read as a tool call; and the way back, a stored reply's `<think>` block handed to the chat template as the message's
`thinking`, as gpt-oss's template reads it.
"""

from __future__ import annotations

import re

from tokenizers.decoders import DecodeStream

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"


def harmony_ids(control: dict[str, int]) -> dict[str, int] | None:
    """The harmony markers' ids, from a tokenizer's control tokens (text -> id); None where it has no harmony."""
    if not all(m in control for m in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>")):
        return None
    return {m: control[m] for m in MARKERS if m in control}


class Channels:
    """The harmony reply's state, fed its pieces in order (a marker, or text): what each piece shows — a header's text
    (a role and recipient after `<|start|>`, a channel's name, a `<|constrain|>` type) nothing, the analysis channel's
    message between THINK_OPEN and THINK_CLOSE, a message to a function (`to=functions.NAME` in its header) nothing:
    it is a call, kept in `calls` as (name, arguments); every other message its text."""

    def __init__(self):
        self.header: list[str] | None = None  # a header's text while one is read (None: in a message's body)
        self.thinking = False  # inside the analysis channel's message
        self.call: tuple[str, list[str]] | None = None  # a call's name and its body so far, while one is read
        self.calls: list[tuple[str, str]] = []

    def marker(self, marker: str) -> str:
        if marker == "<|start|>" or (marker == "<|channel|>" and self.header is None):
            self.header = []  # (a channel after `<|start|>assistant to=…` goes on with the same header)
            return self._close()
        if marker == "<|message|>":  # the header's end: it says what the message is
            header = "".join(self.header or ())
            self.header = None
            called = CALL.search(header)
            if called:
                self.call = (called[1], [])
                return ""
            if header.split(" to=")[0].strip().endswith("analysis") and not self.thinking:
                self.thinking = True
                return THINK_OPEN
            return ""
        if marker in ("<|channel|>", "<|constrain|>"):  # within a header: its parts apart
            if self.header is not None:
                self.header.append(" ")
            return ""
        return self._close()  # <|end|>, <|call|>, <|return|>: a message ends

    def text(self, piece: str) -> str:
        if self.header is not None:
            self.header.append(piece)
            return ""
        if self.call is not None:
            self.call[1].append(piece)
            return ""
        return piece

    def end_call(self) -> str:
        """A call the reply ended inside (no `<|call|>`): kept as the call it was."""
        return self._close() if self.call is not None else ""

    def _close(self) -> str:
        if self.call is not None:
            self.calls.append((self.call[0], "".join(self.call[1]).strip()))
            self.call = None
        if self.thinking:
            self.thinking = False
            return THINK_CLOSE
        return ""


CALL = re.compile(r"\bto=functions\.([A-Za-z0-9_-]{1,64})")  # a message's recipient: one of the request's functions
SPLIT = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")


class HarmonyStream:
    """Token ids of a harmony reply -> text deltas, as Channels shows them (headers and calls not shown, the analysis
    channel as a thinking block). The same interface as engine.text_stream.TextStream."""

    def __init__(self, tok, markers: dict[str, int], start=()):
        self.tok, self.ids, self.text = tok, [], ""
        self.marker = {i: m for m, i in markers.items()}  # id -> marker
        self._body = DecodeStream(skip_special_tokens=True)  # the tokens between markers, as text
        self.channels = Channels()
        for i in start:
            self.push(i)
        self.started = len(self.text)

    @property
    def new_text(self) -> str:
        return self.text[self.started :]

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        marker = self.marker.get(token_id)
        if marker is not None:
            piece = self.channels.marker(marker)
        else:
            piece = self.channels.text(self._body.step(self.tok.tok, token_id) or "")
        self.text += piece
        return piece

    def finish(self) -> str:
        return ""  # every delta was final when pushed (a reply stopped mid-thought leaves its block open)


def read_reply(text: str) -> tuple[str, list[tuple[str, str]]]:
    """A harmony reply's text (its markers kept) -> what it shows and the calls it made [(name, arguments)], as
    HarmonyStream reads the same reply token by token (a call its message ended, or the reply did)."""
    channels, shown = Channels(), []
    for i, piece in enumerate(SPLIT.split(text)):
        shown.append(channels.marker(piece) if i % 2 else channels.text(piece))
    shown.append(channels.end_call())
    return "".join(shown), channels.calls


def thinking_apart(messages: list[dict]) -> list[dict]:
    """Messages for a harmony template: an assistant's content that opens with a `<think>` block gives that block as
    `thinking` and the rest as its content."""
    out = []
    for m in messages:
        content = m.get("content")
        if m.get("role") == "assistant" and isinstance(content, str) and content.lstrip().startswith("<think>"):
            body = content.lstrip()[len("<think>") :]
            thought, _, rest = body.partition("</think>")
            m = {**m, "thinking": thought.strip("\n"), "content": rest.lstrip("\n")}
        out.append(m)
    return out
