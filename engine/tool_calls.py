"""Tool calls in OpenAI's shape over each model family's own format: the tools a request offers (checked and
bounded: they come from outside), the format its chat template teaches the model (Hermes/Qwen/SmolLM3
`<tool_call>`, Llama 3.x JSON, Mistral `[TOOL_CALLS]`, Granite `<|tool_call|>`, Phi-4-mini `functools[…]`, gpt-oss's
harmony messages `to=functions.NAME`), the
calls parsed out of a reply, and the grammar that makes a required or named call parse against its tool's schema.

The model reads the tools through its own template (`tools` in its context) and writes calls as it was trained
to; kvchat only reads them back. Where a call must come (`tool_choice` required or a named function), the reply is
constrained to the family's format with the arguments' JSON schema inside (engine.grammar), written with the
separators the template writes (`", "`, `": "`), so the call the next turn renders is the tokens the reply made.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets

from .errors import EngineError
from .grammar import MAX_SOURCE, Grammar
from .harmony import read_reply

MAX_TOOLS = 128  # tools one request may offer
MAX_CALLS = 64  # calls read out of one reply
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
TEMPLATE_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # json.dumps'


@dataclasses.dataclass(frozen=True)
class Tool:
    """One function a request offers: its name, description and the JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict

    def to_dict(self) -> dict:
        """As OpenAI's `tools` entries hold it (and chat templates read it)."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call the reply made: the function's name and its arguments as JSON text (OpenAI's `arguments`)."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def template_arguments(arguments):
    """A call's arguments as chat templates take them: the JSON object its text holds (as vLLM and transformers
    give templates), or the text itself where it is not one."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def template_call(call_id: str, name: str, arguments) -> dict:
    """One call of an assistant turn as its chat template renders it (OpenAI's shape, the arguments as an object)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": template_arguments(arguments)}}


def read_tools(tools) -> tuple[Tool, ...]:
    """OpenAI's `tools` array, checked: at most MAX_TOOLS functions, each a name of OpenAI's characters, a string
    description, a JSON schema object for its parameters; the whole within a grammar's size."""
    if not isinstance(tools, list):
        raise EngineError("'tools' must be an array of functions")
    if len(tools) > MAX_TOOLS:
        raise EngineError(f"'tools' holds {len(tools)} functions: at most {MAX_TOOLS}")
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict):
            raise EngineError(f'tools[{i}] must be {{"type": "function", "function": {{…}}}}')
        name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not NAME.match(name):
            raise EngineError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-'")
        if name in seen:
            raise EngineError(f"tools[{i}]: the function {name!r} is named twice")
        if not isinstance(params, dict):
            raise EngineError(f"tools[{i}].function.parameters must be a JSON schema object")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise EngineError(f"tools[{i}].function.description must be a string")
        seen.add(name)
        out.append(Tool(name, description, params))
    if len(json.dumps([t.to_dict() for t in out])) > MAX_SOURCE:
        raise EngineError(f"'tools' is larger than the {MAX_SOURCE:,} characters a grammar may take")
    return tuple(out)


def read_choice(choice, tools: tuple[Tool, ...]) -> str:
    """OpenAI's `tool_choice` as one word: "none", "auto", "required", or the named function's name."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:  # as OpenAI answers: a choice among no tools is a mistake, said
            raise EngineError(f"'tool_choice' is {choice} but 'tools' is empty: it is only allowed with tools")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise EngineError("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                          "{\"name\": …}}")  # fmt: skip
    if name not in {t.name for t in tools}:
        raise EngineError(f"'tool_choice' names {name!r}, which is not among the tools")
    return name


# --- the families' formats -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Format:
    """How one family writes calls: `marker` opens them (text, or a control token's string), `close` ends each
    (Hermes), `arguments` is the key the arguments go under, `array`: the calls are one JSON array after the
    marker; else each call is its own object (Hermes: each in its own tags; Llama 3.x: objects joined by "; ")."""

    name: str
    marker: str
    close: str = ""
    arguments: str = "arguments"
    array: bool = False
    gap: str = ""  # what the template writes between the marker and the JSON


FORMATS = {
    "hermes": Format("hermes", "<tool_call>", "</tool_call>", gap="\n"),  # Hermes, Qwen 2.5/3, SmolLM3
    "llama3": Format("llama3", "<|python_tag|>", arguments="parameters"),  # Llama 3.1-3.3: JSON, maybe tagged
    "mistral": Format("mistral", "[TOOL_CALLS]", array=True, gap=" "),
    "granite": Format("granite", "<|tool_call|>", array=True),
    "phi4": Format("phi4", "functools", array=True),  # Phi-4-mini: functools[{…}]
    "harmony": Format("harmony", "to=functions."),  # gpt-oss: a message to a function (engine.harmony)
}


def template_format(template: str | None) -> Format | None:
    """The format a chat template teaches (None: the template takes no tools)."""
    if not template or "tools" not in template:
        return None
    for key, name in (("<|channel|>commentary", "harmony"), ("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                      ("functools", "phi4"),
                      ("<|tool_call|>", "granite"), ("<|python_tag|>", "llama3"), ("ipython", "llama3")):  # fmt: skip
        if key in template:
            return FORMATS[name]
    return FORMATS["hermes"]  # a template that shows tools without a format of its own: the most common one


def offered_format(tokenizer, req, model: str) -> Format | None:
    """The format `model` writes calls in, where request `req` offers tools (None where it offers none);
    EngineError where its chat template takes none (it is never shown the tools some other way)."""
    if not req.tools or req.tool_choice == "none":
        return None
    fmt = template_format(tokenizer.chat_template_source)
    if fmt is None:
        raise EngineError(f"{model}'s chat template takes no tools: it cannot be offered any")
    return fmt


def parse_calls(fmt: Format, text: str) -> tuple[str, list[ToolCall]]:
    """The reply's content and the calls it made (`text`: decoded with control tokens kept). A call that is not
    JSON of the format's shape leaves the whole reply as content: the model wrote text, not a call. A harmony reply's
    content is what its stream shows (its thinking block, its final channel), each message to a function a call."""
    if fmt.name == "harmony":
        shown, made = read_reply(text)
        return shown, [ToolCall(name, arguments) for name, arguments in made[:MAX_CALLS]]
    at = text.find(fmt.marker)
    if fmt.name == "llama3" and at < 0 and text.lstrip().startswith("{"):
        at = len(text) - len(text.lstrip())  # Llama 3.x writes a call as bare JSON too
        body = text[at:]
    elif at < 0:
        return text, []
    else:
        body = text[at + len(fmt.marker) :]
    try:
        calls = _calls(fmt, body)
    except (ValueError, TypeError, KeyError):
        return text, []
    return (text[:at].strip(), calls) if calls else (text, [])


def _calls(fmt: Format, body: str) -> list[ToolCall]:
    decoder = json.JSONDecoder()
    if fmt.array:
        items, _ = decoder.raw_decode(body.strip())
        if not isinstance(items, list):
            raise ValueError("not an array")
    elif fmt.close:  # Hermes: {…}</tool_call> <tool_call>{…}</tool_call> …
        items = []
        for part in body.split(fmt.marker):
            item, _ = decoder.raw_decode(part.strip())
            items.append(item)
    else:  # Llama 3.x: {…}; {…}
        items, rest = [], body.strip()
        while rest:
            item, end = decoder.raw_decode(rest)
            items.append(item)
            rest = rest[end:].strip().removeprefix(";").strip()
    out = []
    for item in items[:MAX_CALLS]:
        if isinstance(item, dict) and isinstance(item.get("function"), dict):  # {"type": "function", "function": …}
            item = item["function"]
        args = item.get(fmt.arguments, item.get("arguments", item.get("parameters", {})))
        if not isinstance(item.get("name"), str):
            raise ValueError("a call without a name")
        out.append(ToolCall(item["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return out


def call_grammar(fmt: Format, tools: tuple[Tool, ...], choice: str, parallel: bool, marker_id: int | None,
                 controls: dict[str, int] | None = None) -> Grammar:  # fmt: skip
    """The grammar of a reply that must call a tool (`choice` "required": any of `tools`; a name: that one), in the
    family's format, the arguments in their schema; `parallel`: one call or more; `marker_id`: the marker's
    control token, where it is one (written as that token, not as its characters); `controls`: harmony's markers'
    ids (gpt-oss: one call, a message to the function, ending the reply)."""
    chosen = [t for t in tools if choice == "required" or t.name == choice]
    if fmt.name == "harmony":
        if not controls or not {"<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"} <= set(controls):
            raise EngineError("this tokenizer lacks harmony's markers: a call cannot be required of it")
        ch, constrain, message, call = (f"<[{controls[m]}]>" for m in ("<|channel|>", "<|constrain|>", "<|message|>",
                                                                       "<|call|>"))  # fmt: skip
        calls = []
        for t in chosen:  # `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}<|call|>`
            schema = json.dumps({"x-guidance": TEMPLATE_LAYOUT, **strict(t.parameters)})
            head = json.dumps(f"commentary to=functions.{t.name} ")
            calls.append(f'{ch} {head} {constrain} "json" {message} %json{schema} {call}')
        return Grammar("lark", "start: " + " | ".join(calls))
    one = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, fmt.arguments: strict(t.parameters)},
                      "required": ["name", fmt.arguments], "additionalProperties": False} for t in chosen]}  # fmt: skip
    marker = f"<[{marker_id}]>" if marker_id is not None else json.dumps(fmt.marker)
    if fmt.gap:
        marker += " " + json.dumps(fmt.gap)
    if fmt.array:
        array = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        lark = f"start: {marker} %json{json.dumps({'x-guidance': TEMPLATE_LAYOUT, **array})}"
    else:
        call = f"%json{json.dumps({'x-guidance': TEMPLATE_LAYOUT, **one})}"
        if fmt.close:
            call = f'{marker} {call} "\\n" {json.dumps(fmt.close)}'
        more = ('"\\n"' if fmt.close else '"; "') + " call"
        lark = f"start: call ({more})*\ncall: {call}" if parallel else f"start: {call}"
    return Grammar("lark", lark)


def strict(schema, depth: int = 0):
    """A schema whose objects hold only the properties they name where they say nothing of others (OpenAI's strict
    mode): a tool without parameters takes `{}`, not keys a model invokes without end."""
    if depth > 32 or not isinstance(schema, (dict, list)):
        return schema
    if isinstance(schema, list):
        return [strict(s, depth + 1) for s in schema]
    out = {k: strict(v, depth + 1) for k, v in schema.items()}
    if out.get("type") == "object" and not {"additionalProperties", "patternProperties"} & set(out):
        out["additionalProperties"] = False
    return out


def marker_token(tokenizer, fmt: Format) -> int | None:
    """The control token the format's marker is, where the tokenizer has it as one (None: it is text)."""
    token = tokenizer.tok.token_to_id(fmt.marker)
    return token if token is not None and token in tokenizer.control_ids else None


class CallFilter:
    """A streamed reply's text split into content, sent as it comes, and a call, held back: once the format's
    marker begins (its text, its control token, or — Llama 3.x — a reply that opens with `{`), nothing more is
    content until the reply ends and its calls are read. A tail that may be the start of the marker waits, and so
    does whitespace at either end (the reply's content is trimmed), so what is sent is always a start of it."""

    def __init__(self, fmt: Format, marker_id: int | None):
        self.fmt, self.marker_id = fmt, marker_id
        self.text = ""  # everything seen
        self.sent = 0  # characters of it sent as content
        self.calling = False

    def feed(self, token_id: int, text: str) -> str:
        """The content to send now for one token."""
        if self.calling:
            self.text += text
            return ""
        if token_id == self.marker_id:
            self.calling = True
            return ""
        self.text += text
        at = self.text.find(self.fmt.marker, self.sent)
        opens_json = self.fmt.name == "llama3" and self.text.lstrip().startswith("{")
        if at >= 0 or opens_json:
            self.calling = True
            end = at if at >= 0 else self.sent
            out = self.text[self.sent : end]
            if not self.text[: self.sent].strip():
                out = out.lstrip()
            self.sent = end
            return out.rstrip()
        if not self.text[self.sent :].strip() and not self.text[: self.sent].strip():
            return ""  # nothing but leading whitespace yet
        if not self.text[: self.sent].strip():
            self.sent = len(self.text) - len(self.text.lstrip())
        cut = len(self.text) - _partial(self.text, self.fmt.marker)
        while cut > self.sent and self.text[cut - 1].isspace():  # and the whitespace before it
            cut -= 1
        out = self.text[self.sent : cut]
        self.sent = max(self.sent, cut)
        return out


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
