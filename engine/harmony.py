"""The harmony format (gpt-oss): a reply is messages on channels — `<|channel|>analysis<|message|>…<|end|>` the
model's reasoning, `<|start|>assistant<|channel|>final<|message|>…` its answer. Its text as kvchat shows every
reasoning model's: the analysis channel as a `<think>` block (the app folds it under "Thinking" and counts its tokens
apart), the final channel as the reply, the markers and headers dropped; and the way back, a stored reply's `<think>`
block handed to the chat template as the message's `thinking`, as gpt-oss's template reads it.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n\n"


def harmony_ids(control: dict[str, int]) -> dict[str, int] | None:
    """The harmony markers' ids, from a tokenizer's control tokens (text -> id); None where it has no harmony."""
    if not all(m in control for m in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>")):
        return None
    return {m: control[m] for m in MARKERS if m in control}


class HarmonyStream:
    """Token ids of a harmony reply -> text deltas: a channel's header (its name, a recipient, a role after
    `<|start|>`) read and not shown; the analysis channel's message between THINK_OPEN and THINK_CLOSE; every other
    channel's message as text. The same interface as engine.text_stream.TextStream."""

    def __init__(self, tok, markers: dict[str, int], start=()):
        self.tok, self.ids, self.text = tok, [], ""
        self.marker = {i: m for m, i in markers.items()}  # id -> marker
        self._body = DecodeStream(skip_special_tokens=True)  # the messages' own tokens
        self._header: list[int] | None = None  # a header's ids while one is read (None: in a message's body)
        self._thinking = False  # inside the analysis channel's message
        for i in start:
            self.push(i)
        self.started = len(self.text)

    @property
    def new_text(self) -> str:
        return self.text[self.started :]

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        piece = self._step(token_id)
        self.text += piece
        return piece

    def _step(self, token_id: int) -> str:
        marker = self.marker.get(token_id)
        if marker in ("<|start|>", "<|channel|>"):  # a header: a role (not shown), then the channel's name
            self._header = []
            return self._close()
        if marker == "<|message|>":  # the header's end: its channel says what the message is
            channel = self.tok.decode(self._header or [], skip_special_tokens=True).strip()
            self._header = None
            if channel.startswith("analysis") and not self._thinking:
                self._thinking = True
                return THINK_OPEN
            return ""
        if marker is not None:  # <|end|>, <|constrain|>, a stop: a message ends (or a header goes on)
            return self._close() if marker != "<|constrain|>" else ""
        if self._header is not None:
            self._header.append(token_id)
            return ""
        return self._body.step(self.tok.tok, token_id) or ""

    def _close(self) -> str:
        if self._thinking:
            self._thinking = False
            return THINK_CLOSE
        return ""

    def finish(self) -> str:
        return ""  # every delta was final when pushed (a reply stopped mid-thought leaves its block open)


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
