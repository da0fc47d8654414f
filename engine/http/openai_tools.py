"""OpenAI's tool-call fields on the wire: `tools`, `tool_choice` and `parallel_tool_calls` read from a request,
the conversation's `tool_calls` and `role: "tool"` turns read into messages a chat template renders, and a reply's
calls written back — whole (`message.tool_calls`) or streamed (`delta.tool_calls`)."""

from __future__ import annotations

from ..errors import EngineError
from ..tool_calls import MAX_CALLS, read_choice, read_tools, template_arguments


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
        call = {"name": fn["name"], "arguments": template_arguments(fn.get("arguments", "{}"))}
        out.append({"id": str(c.get("id", "")), "type": "function", "function": call})
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
