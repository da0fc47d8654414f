"""OpenAI's tool-call fields on the wire: `tools`, `tool_choice` and `parallel_tool_calls` read from a request,
the conversation's `tool_calls` and `role: "tool"` turns read into messages a chat template renders, and a reply's
calls written back — whole (`message.tool_calls`) or streamed (`delta.tool_calls`)."""

from __future__ import annotations

import json

from ..errors import EngineError
from ..tool_calls import MAX_CALLS, ToolCall, read_choice, read_tools, template_call

MAX_ARGUMENTS = 1024 * 1024  # characters of one call's arguments read from a remote server's stream


class FieldError(EngineError):
    """A tool field that is not what OpenAI's API takes: `param` names it (the server answers 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def tool_fields(body: dict) -> dict:
    """The Request's tools, tool_choice and parallel_tool_calls from a body; FieldError naming the field otherwise."""
    try:
        tools = read_tools(body.get("tools") or [])
    except EngineError as e:
        raise FieldError(str(e), "tools") from None
    try:
        choice = read_choice(body.get("tool_choice"), tools)
    except EngineError as e:
        raise FieldError(str(e), "tool_choice") from None
    parallel = body.get("parallel_tool_calls", True)
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": bool(parallel)}


def message_calls(m: dict, i: int) -> list[dict] | None:
    """An assistant message's `tool_calls` as a template renders them (each call's arguments as an object, as
    vLLM and transformers give templates; arguments that are not a JSON object stay text); None without any."""
    calls = m.get("tool_calls")
    if calls is None:
        return None
    if not isinstance(calls, list) or len(calls) > MAX_CALLS:
        raise FieldError(f"messages[{i}].tool_calls must be an array of at most {MAX_CALLS} calls", "messages")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise FieldError(f"messages[{i}].tool_calls: each call needs function.name", "messages")
        out.append(template_call(str(c.get("id", "")), fn["name"], fn.get("arguments", "{}")))
    return out


def tool_message(m: dict, content: str) -> dict:
    """A `role: "tool"` turn: the result's text and the call it answers."""
    out = {"role": "tool", "content": content}
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def call_list(calls) -> list[dict]:
    """A reply's calls as `message.tool_calls`."""
    return [c.to_dict() for c in calls]


def call_deltas(calls) -> list[dict]:
    """A reply's calls as streamed `delta.tool_calls`: each call whole in one delta, with its index."""
    return [{"index": i, **c.to_dict()} for i, c in enumerate(calls)]


# --- to a remote server, and its calls back -------------------------------------------------------------------
def offered_tools(req) -> dict:
    """A request's tools as a server takes them (OpenAI's fields: vLLM, SGLang, llama-server, Ollama, kvchat)."""
    if not req.tools or req.tool_choice == "none":
        return {}
    choice = req.tool_choice
    if choice not in ("auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    return {"tools": [t.to_dict() for t in req.tools], "tool_choice": choice,
            "parallel_tool_calls": req.parallel_tool_calls}  # fmt: skip


def wire_messages(messages) -> list[dict]:
    """Messages as OpenAI's API takes them: a call's arguments as JSON text (a template reads them as objects), a
    message's images (engine.images.Image) as image_url parts with data: URLs before its text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            calls = [{**c, "function": {**c["function"], "arguments": _text(c["function"].get("arguments"))}}
                     for c in calls]  # fmt: skip
            m = {**m, "tool_calls": calls}
        images = m.get("images") if isinstance(m, dict) else None
        if images is not None:
            parts = [{"type": "image_url", "image_url": {"url": im.data_url()}} for im in images]
            m = {k: v for k, v in m.items() if k != "images"}
            if parts:
                m["content"] = parts + [{"type": "text", "text": m.get("content") or ""}]
        out.append(m)
    return out


def _text(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


class StreamedCalls:
    """A server's streamed `delta.tool_calls`, put back together by index: each call's id and name once, its
    arguments in pieces; bounded (MAX_CALLS calls, MAX_ARGUMENTS characters each)."""

    def __init__(self):
        self.calls: dict[int, dict] = {}

    def add(self, deltas) -> None:
        for d in deltas if isinstance(deltas, list) else ():
            if not isinstance(d, dict):
                continue
            i = d.get("index", len(self.calls))
            if type(i) is not int or (i not in self.calls and len(self.calls) >= MAX_CALLS):
                continue
            call = self.calls.setdefault(i, {"id": "", "name": "", "arguments": ""})
            fn = d.get("function") if isinstance(d.get("function"), dict) else {}
            for key, value in (("id", d.get("id")), ("name", fn.get("name"))):
                if isinstance(value, str) and value and not call[key]:
                    call[key] = value[:200]
            args = fn.get("arguments")
            if isinstance(args, dict):  # a server that sends the object itself (Ollama's native shape)
                args = json.dumps(args, ensure_ascii=False)
            if isinstance(args, str) and len(call["arguments"]) + len(args) <= MAX_ARGUMENTS:
                call["arguments"] += args

    def result(self) -> tuple[ToolCall, ...]:
        return tuple(ToolCall(c["name"], c["arguments"] or "{}", *([c["id"]] if c["id"] else []))
                     for _, c in sorted(self.calls.items()) if c["name"])  # fmt: skip
