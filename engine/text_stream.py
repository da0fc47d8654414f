"""A reply's token ids as text deltas, as they stream: never half a UTF-8 character, and together exactly the text
of all the ids (engine.harmony's stream does the same for gpt-oss's channels). Apart from engine.tokenizer, which
picks the stream a model's replies take."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class TextStream:
    """Turns token ids into text deltas that never split a UTF-8 character.

    The deltas concatenate to exactly `decode(all ids)`: `finish()` returns whatever the
    incremental decoder still holds (e.g. the bytes of a character the reply stopped inside).
    """

    def __init__(self, tokenizer, start=()):  # tokenizer: an engine.tokenizer.Tokenizer (its decode, its tok)
        self.tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.text = ""
        for i in start:
            self.push(i)
        self.text = tokenizer.decode(self.ids) if start else ""
        self.started = len(self.text)  # the text of `start`: new_text is what comes after it

    @property
    def new_text(self) -> str:
        return self.text[self.started :]

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        piece = self._stream.step(self.tokenizer.tok, token_id) or ""
        self.text += piece
        return piece

    def finish(self) -> str:
        full = self.tokenizer.decode(self.ids)
        if full.startswith(self.text):
            rest = full[len(self.text) :]
        else:  # a decoder whose streamed pieces differ from the whole: trust the whole
            rest = ""
        self.text += rest
        return rest
