"""Tokenizing with the `tokenizers` library and chat templates rendered in a jinja2 sandbox.

The template environment follows the Hugging Face conventions (trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII, the
`{% generation %}` tag) so a published template gives the ids `apply_chat_template` gives.
Model files are untrusted: templates run in jinja2's immutable sandbox, with a bound on what one
operation may build and on how long and how much a render may take, so a hostile template is an
error naming the limit, never a hang or a process grown to the machine's memory.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import json
import operator
import re
import sys
import time
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .config import read_json
from .errors import EngineError, ModelLoadError, TemplateError
from .harmony import HarmonyStream, harmony_ids, thinking_apart
from .images import IMAGE_TEXT, ImageError, text_with_images
from .text_stream import TextStream

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
TEMPLATE_SECONDS = 2.0  # a render may take this long (a real template takes well under a millisecond)
TEMPLATE_CHARS = 4_000_000  # a render, or one value it builds, may be this long (far past any context)
SCAN_SECONDS = 0.001  # a render's values are measured this often: memory copies bound what grows between


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


def _too_big(what: str, n: int) -> TemplateError:
    return TemplateError(f"the chat template tried to build {what} of {n:,} items (the limit is {TEMPLATE_CHARS:,})")


FORMAT_WIDTH = re.compile(r"\{[^{}]*?(\d{7,})[^{}]*\}|%[-+ #0]*(\d{7,})|%[-+ #0]*\d*\.(\d{7,})")
TOJSON_INDENT = 64  # tojson's indent may be this many spaces (templates use 2 or 4)
LIPSUM_WORDS = 100_000  # lipsum may write this many words


def _refuse_format_width(spec: str) -> None:
    """A format string (str.format's or %'s) that asks for a width or precision past the limit is refused."""
    if FORMAT_WIDTH.search(spec):
        raise TemplateError("the chat template asked for a format width past the limit")


def _check_growth(name: str, args: tuple, kwargs: dict) -> None:
    """Refuse, before it runs, a built-in call whose result would pass TEMPLATE_CHARS: any number past the
    limit (a width, a count, a padding), and the calls whose output grows as a product of their inputs
    (replace, join, indent, expandtabs, a format's width)."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > TEMPLATE_CHARS:
            raise TemplateError(f"the chat template passed {v:,} to {name} (the limit is {TEMPLATE_CHARS:,})")
    first = args[0] if args else None
    if isinstance(first, str):
        if name == "replace" and len(args) >= 3 and isinstance(args[1], str) and isinstance(args[2], str):
            n = len(first) + (len(first) + 1 if not args[1] else first.count(args[1])) * len(args[2])
            if n > TEMPLATE_CHARS:
                raise _too_big("a replaced string", n)
        elif name == "expandtabs":
            n = len(first) + first.count("\t") * int(args[1] if len(args) > 1 else kwargs.get("tabsize", 8))
            if n > TEMPLATE_CHARS:
                raise _too_big("an expanded string", n)
        elif name == "indent":
            width = args[1] if len(args) > 1 else kwargs.get("width", 4)
            n = len(first) + (first.count("\n") + 1) * (width if isinstance(width, int) else len(str(width)))
            if n > TEMPLATE_CHARS:
                raise _too_big("an indented string", n)
        elif name in ("format", "format_map"):
            _refuse_format_width(first)
    if name == "join" and len(args) >= 2:
        seq, sep = (args[1], args[0]) if isinstance(args[0], str) else (args[0], args[1] if len(args) > 1 else "")
        if isinstance(seq, (list, tuple)) and isinstance(sep, str):
            n = sum(len(x) if isinstance(x, str) else 1 for x in seq) + len(sep) * max(len(seq) - 1, 0)
            if n > TEMPLATE_CHARS:
                raise _too_big("a joined string", n)
    if name == "tojson":
        indent = kwargs.get("indent", args[1] if len(args) > 1 else None)
        if isinstance(indent, int) and indent > TOJSON_INDENT:
            raise TemplateError(
                f"the chat template asked tojson for an indent of {indent:,} (the limit is {TOJSON_INDENT})"
            )


def _size(v) -> int:
    return len(v) if isinstance(v, (str, list, tuple, dict)) else 0


PASSED_ALONG = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)  # a filter's first arguments


def _bounded_filter(name: str, fn):
    """A jinja2 filter that first refuses a call past the limits (filters are called directly by the
    compiled template, not through the sandbox's call)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        shown = [a for a in args if not isinstance(a, PASSED_ALONG)]
        _check_growth(name, tuple(shown), kwargs)
        return fn(*args, **kwargs)

    return call


def lipsum(n=5, html=True, min=20, max=100):
    if n * max > LIPSUM_WORDS:
        raise TemplateError(f"the chat template asked lipsum for {n * max:,} words (the limit is {LIPSUM_WORDS:,})")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox where no one operation can build a value past the limits: `*`, `**`, `+` and
    `%` are checked before they run, and so is every call of a built-in (a method, a filter, lipsum)
    that grows its output from a number or from a product of its inputs."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, op, left, right):
        if op == "+":  # first: what templates do most, joining text
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                if len(left) + len(right) > TEMPLATE_CHARS:
                    raise _too_big("a value", len(left) + len(right))
            return operator.add(left, right)
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > TEMPLATE_CHARS:
                    raise _too_big("a value", len(seq) * n)
            return operator.mul(left, right)
        if op == "%":
            if isinstance(left, str):
                _refuse_format_width(left)
                _check_growth("%", right if isinstance(right, tuple) else (right,), {})
            return operator.mod(left, right)
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * abs(left).bit_length() > 8 * TEMPLATE_CHARS:
                raise TemplateError(f"the chat template tried to compute {left} ** {right}: too large")
        return operator.pow(left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # jinja2's own signature
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "a function").removeprefix("safe_")
        if isinstance(owner, str):  # a string's method: the string is its first input
            _check_growth(name, (owner, *args), kwargs)
        elif owner is None or not isinstance(owner, jinja2.runtime.Context):
            _check_growth(name, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):  # str.format is wrapped where it is looked up, not where it is called
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _refuse_format_width(value.__self__)
        return wrapped


def _render_bounded(template: jinja2.Template, **context) -> str:
    """template.render(**context) under TEMPLATE_SECONDS and TEMPLATE_CHARS: the template's own lines are
    traced, stopped past the deadline (a loop that writes nothing cannot hang the engine) and their values
    measured every SCAN_SECONDS (a value grown line by line, `{% set ns.x = ns.x ~ ns.x %}`, stops within
    what memory can copy in that time past the limit)."""
    deadline = time.monotonic() + TEMPLATE_SECONDS
    scanned = [0.0]  # when the values were last measured

    def on_line(frame, event, arg):
        t = time.monotonic()
        if t > deadline:
            raise TemplateError(f"the chat template ran past its limit of {TEMPLATE_SECONDS:g} s")
        if t - scanned[0] < SCAN_SECONDS:
            return on_line
        scanned[0] = t
        for v in frame.f_locals.values():
            if isinstance(v, jinja2.utils.Namespace):  # {% set ns.x = ns.x ~ ns.x %}
                v = max(v._Namespace__attrs.values(), key=_size, default=None)
            if _size(v) > TEMPLATE_CHARS:
                raise _too_big("a value", _size(v))
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
    env.filters.update({name: _bounded_filter(name, fn) for name, fn in env.filters.items()})
    env.globals["lipsum"] = lipsum
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


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A conversation as the model reads it: the template's token ids, and each message's own text as prompt
    positions [first, end) (an empty span where the template does not show the message verbatim). The
    positions between them are the template's: turn markers, a default system prompt, the generation prompt."""

    ids: list[int]
    spans: tuple[tuple[int, int], ...]
    images: tuple = ()  # the engine.images.Image each run of image positions among `ids` stands for, in order


def _content_chars(text: str, messages: list[dict]) -> list[tuple[int, int]]:
    """Each message's content as characters [a, b) of the rendered text, found in order (as written, or
    trimmed, as templates may); an empty span at the place reached where it is not there verbatim."""
    spans, pos = [], 0
    for m in messages:
        content = m.get("content")
        found = None
        if isinstance(content, str) and content.strip():
            for c in (content, content.strip()):
                at = text.find(c, pos)
                if at >= 0:
                    found = (at, at + len(c))
                    break
        spans.append(found or (pos, pos))
        pos = spans[-1][1]
    return spans


def _token_spans(chars, offsets, place) -> tuple[tuple[int, int], ...]:
    """Character spans as token positions: a token that overlaps a message's text counts as the message's.
    `place[k]` is where the text's token k starts among the prompt's ids (a typed control token is several)."""
    starts = [a for a, _ in offsets]
    ends = [b for _, b in offsets]
    out = []
    for a, b in chars:
        first = bisect.bisect_right(ends, a)  # the first token that ends past the text's start
        end = bisect.bisect_left(starts, b) if b > a else first  # the first token that starts at its end or later
        out.append((place[first], place[max(first, end)]))
    return tuple(out)


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
        self.harmony = harmony_ids({text: i for i, text in controls.items()})  # gpt-oss's channels (engine.harmony)
        self._as_text: HFTokenizer | None = None  # a copy that reads special-token strings as plain text
        self.images = None  # a model that sees images: its family's engine.image_prompt.ImageFormat (the loader's)

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
        """Text of `ids`; a run of an image's positions (negative ids, engine.images) reads as IMAGE_TEXT once."""
        return text_with_images(list(ids), lambda run: self.tok.decode(run, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token as a person reads it (decoded, special tokens kept); an image's position as IMAGE_TEXT."""
        if token_id < 0:
            return IMAGE_TEXT
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
        """Rendered text, encoded without adding special tokens (the template writes them)."""
        return self.chat_prompt(messages, add_generation_prompt, continue_final_message, **kwargs).ids

    def chat_prompt(
        self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False, **kwargs
    ) -> ChatPrompt:
        """The prompt's ids and where each message's own text lies among them. Control tokens count only where
        the template wrote them: one that falls inside a message's own text is encoded as that text (the rest
        of the ids are exactly the rendered text's)."""
        if self.harmony is not None:  # a stored reply's thinking as the template's own field
            messages = thinking_apart(messages)
        pictures = [p for m in messages for p in (m.get("images") or ())]
        if pictures and self.images is None:
            raise ImageError("this model does not see images: it has no vision encoder; remove the images or open a "
                             "model that sees them (Gemma 3 4B and up, SmolVLM, Qwen2.5-VL)")  # fmt: skip
        shown = [self.images.template_message(m) for m in messages] if pictures else messages
        text = self.render(shown, add_generation_prompt, continue_final_message, **kwargs)
        chars = _content_chars(text, messages)
        if pictures:
            text = self.images.expand(text, chars, pictures)
            chars = _content_chars(text, messages)
        enc = self._encoding(text)
        offsets = enc.offsets
        typed = [c for c in chars if c[1] > c[0]]
        if not any(s in text[a:b] for a, b in typed for s in self._control_strings):  # the usual case: nothing typed
            out, spans = enc.ids, _token_spans(chars, offsets, range(len(offsets) + 1))
        else:
            out, at = [], []  # the ids, and where each of the text's tokens starts among them
            for i, (a, b) in zip(enc.ids, offsets):
                at.append(len(out))
                forged = i in self.control_ids and any(s <= a and b <= e for s, e in typed)
                out += self.encode_text(text[a:b]) if forged else [i]
            spans = _token_spans(chars, offsets, [*at, len(out)])
        if not pictures:
            return ChatPrompt(out, spans)
        image_id = self.tok.token_to_id(self.images.image_token)
        return ChatPrompt(self.images.mark(out, pictures, image_id), spans, tuple(pictures))

    def stream(self, start=()) -> TextStream | HarmonyStream:
        """A stream of text deltas; `start`: ids already written (a reply's forced start), decoded first. A harmony
        reply's channels as a thinking block and the answer (engine.harmony)."""
        if self.harmony is not None:
            return HarmonyStream(self, self.harmony, start)
        return TextStream(self, start)
