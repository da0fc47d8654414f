"""Tokenizing with the `tokenizers` library and chat templates rendered in a jinja2 sandbox.

The template environment follows the Hugging Face conventions (trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII, the
`{% generation %}` tag) so a published template gives the ids `apply_chat_template` gives.
Model files are untrusted: templates run in jinja2's immutable sandbox, with a bound on what one
operation may build and on how long and how much a render may take, so a hostile template is an
error naming the limit, never a hang or a process grown to the machine's memory.
"""

from __future__ import annotations

import hashlib
import json
import operator
import sys
import time
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from .config import read_json
from .errors import EngineError, ModelLoadError, TemplateError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
TEMPLATE_SECONDS = 2.0  # a render may take this long (a real template takes well under a millisecond)
TEMPLATE_CHARS = 4_000_000  # a render, or one value it builds, may be this long (far past any context)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; it renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox where `*` and `**` cannot build a value past the limits: a string or list
    repeated, or an integer raised, beyond TEMPLATE_CHARS is refused before it is built."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, op, left, right):
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > TEMPLATE_CHARS:
                    raise TemplateError(
                        f"the chat template tried to build a value of {len(seq) * n:,} items "
                        f"(the limit is {TEMPLATE_CHARS:,})"
                    )
            return operator.mul(left, right)
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * abs(left).bit_length() > 8 * TEMPLATE_CHARS:
                raise TemplateError(f"the chat template tried to compute {left} ** {right}: too large")
        return operator.pow(left, right)


def _render_bounded(template: jinja2.Template, **context) -> str:
    """template.render(**context) under TEMPLATE_SECONDS and TEMPLATE_CHARS: the template's own lines are
    traced and stopped past the deadline (a loop that writes nothing cannot hang the engine)."""
    deadline = time.monotonic() + TEMPLATE_SECONDS

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateError(f"the chat template ran past its limit of {TEMPLATE_SECONDS:g} s")
        return on_line

    def on_call(frame, event, arg):  # only the template's own code is traced
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        out, size = [], 0
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > TEMPLATE_CHARS:
                raise TemplateError(f"the chat template wrote more than {TEMPLATE_CHARS:,} characters")
            out.append(chunk)
        return "".join(out)
    finally:
        sys.settrace(previous)


def compile_template(source: str) -> jinja2.Template:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template does not parse: {e}") from None


def _said(e: BaseException) -> str:
    """An exception as a person reads it: its message, or its kind when it has none."""
    return str(e) or type(e).__name__


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A model folder's tokenizer: ids, text, chat template and stop tokens."""

    def __init__(
        self, tok: HFTokenizer, special: dict[str, str], chat_template: str | None, stop_ids: set[int], digest: str = ""
    ):
        self.tok = tok
        self.special = special  # bos_token/eos_token/... -> text
        self.chat_template_source = chat_template
        self._template = compile_template(chat_template) if chat_template else None
        self.stop_ids = frozenset(stop_ids)
        self.digest = digest  # sha256 of the tokenizer files' contents, for the fingerprint (the text is not kept)
        controls = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self.control_ids, self._control_strings = frozenset(controls), tuple(set(controls.values()))
        self._as_text: HFTokenizer | None = None  # a copy that reads special-token strings as plain text

    @classmethod
    def from_dir(cls, model_dir: Path, extra_stop_ids=()) -> Tokenizer:
        model_dir = Path(model_dir)
        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise ModelLoadError("missing tokenizer.json (only the fast-tokenizer format is supported)", tok_path)
        try:
            raw_tok = tok_path.read_text(encoding="utf-8")
            tok = HFTokenizer.from_str(raw_tok)
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise ModelLoadError(f"tokenizer.json cannot be read: {e}", tok_path) from None
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = read_json(cfg_path, default={})
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = model_dir / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")
        special = {k: _token_text(cfg.get(k)) for k in SPECIAL_TOKEN_KEYS if _token_text(cfg.get(k)) is not None}
        stop = set(int(i) for i in extra_stop_ids)
        eos = read_json(model_dir / "generation_config.json", default={}).get("eos_token_id")
        stop.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        if "eos_token" in special and tok.token_to_id(special["eos_token"]) is not None:
            stop.add(tok.token_to_id(special["eos_token"]))
        digest = hashlib.sha256()
        for part in (raw_tok, json.dumps(cfg, sort_keys=True), template or ""):
            digest.update(part.encode())
        del raw_tok
        try:
            return cls(tok, special, template, stop, digest.hexdigest())
        except TemplateError as e:
            raise ModelLoadError(str(e), cfg_path) from None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._encoding(text, add_special_tokens).ids

    def _encoding(self, text: str, add_special_tokens: bool = False, tok: HFTokenizer | None = None):
        """(tok or self.tok).encode(text), with text that is not valid Unicode as a clear error. Through
        encode_batch, which lets go of the GIL while it works (encode holds it: a long conversation's
        tokenizing froze the app's window for as long)."""
        try:
            return (tok or self.tok).encode_batch([text], add_special_tokens=add_special_tokens)[0]
        except TypeError:
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:  # a lone surrogate: no UTF-8 text, so no tokens
                    raise EngineError(
                        f"the text holds {text[e.start]!r}, which is not valid Unicode; nothing was sent to the model"
                    ) from None
            raise

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as a person reads it (decoded, special tokens kept)."""
        return self.tok.decode([token_id], skip_special_tokens=False)

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False, **kwargs
    ) -> str:
        """The template's text. continue_final_message cuts it right after the last message's content,
        so generation extends that message (as transformers does)."""
        if continue_final_message:
            text = self.render(messages, add_generation_prompt=False, **kwargs)
            final = messages[-1]["content"]
            cut = text.rfind(final.strip()) if final.strip() else -1
            if cut < 0:
                raise TemplateError("cannot continue the last message: the template does not show it verbatim")
            return text[: cut + len(final.strip())]
        if self._template is None:
            raise TemplateError("this model has no chat template; use a raw prompt")
        context = {**self.special, **kwargs}
        try:
            return _render_bounded(
                self._template,
                messages=[dict(m) for m in messages],
                tools=kwargs.get("tools"),
                documents=kwargs.get("documents"),
                add_generation_prompt=add_generation_prompt,
                **{k: v for k, v in context.items() if k not in ("tools", "documents")},
            )
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"chat template tried something the sandbox forbids: {e}") from None
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"chat template refused the conversation: {_said(e)}") from None
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError) as e:
            raise TemplateError(f"chat template failed: {_said(e)}") from None

    def encode_text(self, text: str) -> list[int]:
        """What a person typed, as text: a special token's string in it (`<|end|>`) is encoded as its
        characters, never as the control token, so typing one cannot forge a turn."""
        if self._as_text is None:
            self._as_text = HFTokenizer.from_str(self.tok.to_str())
            self._as_text.encode_special_tokens = True
        return self._encoding(text, tok=self._as_text).ids

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False, **kwargs
    ) -> list[int]:
        """Rendered text, encoded without adding special tokens (the template writes them). Control
        tokens count only where the template wrote them: one that falls inside a message's own text is
        encoded as that text (the rest of the ids are exactly the rendered text's)."""
        text = self.render(messages, add_generation_prompt, continue_final_message, **kwargs)
        contents = [m.get("content") for m in messages if isinstance(m.get("content"), str)]
        if not any(s in c for c in contents for s in self._control_strings):  # the usual case: nothing typed
            return self.encode(text, add_special_tokens=False)
        spans, pos = [], 0
        for content in contents:
            if not content.strip():
                continue
            for c in (content, content.strip()):  # templates may trim
                at = text.find(c, pos)
                if at >= 0:
                    spans.append((at, at + len(c)))
                    pos = at + len(c)
                    break
        enc = self._encoding(text)
        out = []
        for i, (a, b) in zip(enc.ids, enc.offsets):
            typed = i in self.control_ids and any(s <= a and b <= e for s, e in spans)
            out += self.encode_text(text[a:b]) if typed else [i]
        return out

    def stream(self) -> TextStream:
        return TextStream(self)


class TextStream:
    """Turns token ids into text deltas that never split a UTF-8 character.

    The deltas concatenate to exactly `decode(all ids)`: `finish()` returns whatever the
    incremental decoder still holds (e.g. the bytes of a character the reply stopped inside).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.text = ""

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
