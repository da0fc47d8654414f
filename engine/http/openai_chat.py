"""The OpenAI chat-completions format, both ways, in one place: a request body parsed into the engine's Request
(the server) and built from one (the remote client); a reply and its stream's chunks written, with usage,
logprobs and kvchat's own `kvchat` extension object, and read back; error objects. No HTTP here: the
server and the client carry these dicts."""

from __future__ import annotations

import dataclasses
import json
import math

from .. import trace as tracing
from ..errors import EngineError
from ..events import STOP_REASONS, Failed, Finished, ReuseReport
from ..grammar import Grammar
from ..images import ImageError, data_url_image
from ..logprobs import MAX_TOP_LOGPROBS, Alternative, StepLogprobs
from ..request import OVERFLOW_POLICIES, Request
from ..sampling import SamplingParams
from .openai_tools import (
    FieldError,
    call_list,
    message_calls,
    offered_tools,
    tool_fields,
    tool_message,
    wire_messages,
)

# The engine's stop reason -> OpenAI's finish_reason (what the server sends).
FINISH_REASONS = {k: r.finish for k, r in STOP_REASONS.items() if r.finish}
# OpenAI's finish_reason -> the engine's stop reason (what the client reads; "stop" cannot tell eos from a
# stop string, and a server's content filter or tool call ends the reply as an end of text would).
STOP_REASONS_BY_FINISH = {"stop": "eos", "length": "max_new_tokens", "content_filter": "eos", "tool_calls": "eos"}

EXTENSION = "kvchat"  # the object beside OpenAI's fields: in a model card, a response and a stream's chunks
# Keys inside it.
REUSE = "reuse"  # the reuse report (ReuseReport.to_dict): a stream's first chunk, and the last
TRACE = "trace"  # the request's trace: the last chunk (its presence marks the final report)
CACHE = "cache"  # the working cache's figures, without the store's
STORE = "store"  # the prefix store's figures and tree
PROMPT_TOKENS = "prompt_tokens"  # positions in the prompt as the engine tokenized it
TOKENS = "tokens"  # tokens a content chunk carries, when more than one (made while the last chunk was sent)
ERROR = "error"  # a failed request's message, in the final report

STATUS_BY_KIND = {"CapacityError": 413, "TemplateError": 400, "EngineError": 400, "ValueError": 400, "ImageError": 400}
NUMBER, INTEGER = "number", "integer"
# The request fields kvchat reads and the JSON type each must have (None allowed for all); others are ignored.
FIELDS = {
    "model": str,
    "messages": list,
    "stream": bool,
    "stream_options": dict,
    "temperature": NUMBER,
    "top_p": NUMBER,
    "top_k": INTEGER,
    "min_p": NUMBER,
    "repetition_penalty": NUMBER,
    "max_tokens": INTEGER,
    "max_completion_tokens": INTEGER,
    "stop": (str, list),
    "seed": INTEGER,
    "n": INTEGER,
    "add_generation_prompt": bool,  # vLLM's names: continue the last (assistant) message instead of a new one
    "continue_final_message": bool,
    "ignore_eos": bool,  # vLLM's: run to max_tokens past the stop tokens (benchmarks)
    "logprobs": bool,
    "top_logprobs": INTEGER,
    "overflow": str,  # kvchat's: a prompt longer than the cache allows (engine.request.OVERFLOW_POLICIES)
    "response_format": dict,  # text, json_object, json_schema: structured output (engine.grammar)
    "grammar": str,  # llama-server's: a GBNF grammar the reply must parse as
    "tools": list,  # functions the model may call (engine/http/openai_tools.py)
    "tool_choice": (str, dict),
    "parallel_tool_calls": bool,
}
# Fields kvchat does not implement: accepted only at the value that means "off".
UNSUPPORTED = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "functions": [],
    "function_call": "none",
    "logit_bias": {},
}
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHOICES = 16  # `n`: choices of one prompt a request may ask for (they share one prefill: engine/http/answers.py)


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, the offending parameter, a code."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None):
        """As the server's HTTP response (Starlette's, imported only by the server's use of it)."""
        from starlette.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def failure(ev: Failed) -> ApiError:
    """A failed request as the error object a client gets: 413 for a prompt too long, 400 for what it sent."""
    status = STATUS_BY_KIND.get(ev.kind, 500)
    code = "context_length_exceeded" if ev.kind == "CapacityError" else None
    return ApiError(status, ev.error, "invalid_request_error" if status < 500 else "server_error", code=code)


# --- a request body -> Request (the server) ---------------------------------------------------------------
def _type_ok(value, want) -> bool:
    if value is None:
        return True
    if want == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if want == INTEGER:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, want) and (want is not int or not isinstance(value, bool))


def _type_name(want) -> str:
    names = {str: "a string", list: "an array", dict: "an object", bool: "a boolean", NUMBER: "a number"}
    if isinstance(want, tuple):
        return " or ".join(_type_name(w) for w in want)
    return names.get(want, "an integer")


def _content(content, i: int, fetch=None) -> tuple[str, tuple]:
    """A message's content as (text, images): a string, or OpenAI's list of parts, text and image_url (a data: URL;
    an http(s) one only where the server fetches them: `fetch`, else refused)."""
    if content is None or isinstance(content, str):
        return content or "", ()
    if not isinstance(content, list):
        raise ApiError(400, f"messages[{i}].content must be a string or an array of parts", param="messages")
    texts, images = [], []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ApiError(400, f"messages[{i}].content[{k}].image_url needs a url", param="messages")
            try:
                if url.startswith(("http://", "https://")) and fetch is not None:
                    images.append(fetch(url))
                elif url.startswith("data:"):
                    images.append(data_url_image(url, f"image {len(images) + 1} of messages[{i}]"))
                else:
                    raise ImageError("image URLs are fetched only where the server allows it (engine serve "
                                     "--allow-image-urls); send the image as a data: URL")  # fmt: skip
            except ImageError as e:
                raise ApiError(400, f"messages[{i}].content[{k}]: {e}", param="messages") from None
        else:
            raise ApiError(400, f"messages[{i}].content[{k}]: only text and image_url parts are supported",
                           param="messages")  # fmt: skip
    return "".join(texts), tuple(images)


def _message(m, i: int, fetch=None) -> dict:
    """One of `messages`, as the chat template renders it: its role (developer is system), its text and images,
    and an assistant's calls or a tool's result where it holds them."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ApiError(400, f"messages[{i}] needs a role among {', '.join(ROLES)}", param="messages")
    role = "system" if m["role"] == "developer" else m["role"]
    content, images = _content(m.get("content"), i, fetch)
    if images and role != "user":
        raise ApiError(400, f"messages[{i}]: images go in user messages", param="messages")
    if role == "tool":
        return tool_message(m, content)
    out = {"role": role, "content": content} | ({"images": images} if images else {})
    calls = message_calls(m, i) if role == "assistant" else None
    if calls:
        out["tool_calls"] = calls
    return out


def _or(body: dict, name: str, default):
    value = body.get(name)
    return default if value is None else value


def response_grammar(fmt: dict | None) -> Grammar | None:
    """OpenAI's `response_format` as a grammar: text (none), json_object (any JSON object) or json_schema (its
    `json_schema.schema`); anything else a 400 that names what is wrong."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind != "json_schema":
        raise ApiError(400, "'response_format.type' must be text, json_object or json_schema", param="response_format")
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, (dict, bool)):
        raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema (an object)",
                       param="response_format")  # fmt: skip
    return checked(lambda: Grammar.json_schema(schema), "response_format")


def checked(make, param: str) -> Grammar:
    """The grammar `make()` makes, where it compiles; else a 400 in the library's words naming `param`."""
    try:
        grammar = make()
        grammar.check()
    except EngineError as e:
        raise ApiError(400, str(e), param=param) from None
    return grammar


def parse_chat(body, max_new_default: int, overflow_default: str = "stop", fetch=None) -> tuple[Request, dict]:
    """A chat-completions body → the engine's Request and the response options (stream, usage). `fetch(url)`: an
    http(s) image URL's Image, where the server fetches them (None: refused)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, want in FIELDS.items():
        if name in body and not _type_ok(body[name], want):
            raise ApiError(400, f"'{name}' must be {_type_name(want)}, not {json.dumps(body[name])}", param=name)
    for name, off in UNSUPPORTED.items():
        if body.get(name) not in (None, off):
            raise ApiError(400, f"'{name}' is not supported by kvchat (only {json.dumps(off)})", param=name)
    msgs = body.get("messages")
    if not msgs:
        raise ApiError(400, "'messages' must be a non-empty array", param="messages")
    try:
        messages = [_message(m, i, fetch) for i, m in enumerate(msgs)]
        tools = tool_fields(body)
    except FieldError as e:
        raise ApiError(400, str(e), param=e.param) from None
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a string or an array of non-empty strings", param="stop")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and limit < 1:
        raise ApiError(400, "'max_tokens' must be at least 1", param="max_tokens")
    try:
        sampling = SamplingParams(
            temperature=_or(body, "temperature", 1.0),
            top_p=_or(body, "top_p", 1.0),
            top_k=_or(body, "top_k", 0),
            min_p=_or(body, "min_p", 0.0),
            repetition_penalty=_or(body, "repetition_penalty", 1.0),
            seed=body.get("seed"),
        )
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    logprobs, top = bool(body.get("logprobs")), body.get("top_logprobs")
    if top is not None and not logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
    overflow = _or(body, "overflow", overflow_default)
    if overflow not in OVERFLOW_POLICIES:
        raise ApiError(400, f"'overflow' must be one of {', '.join(OVERFLOW_POLICIES)}", param="overflow")
    grammar = response_grammar(body.get("response_format"))
    if grammar is None and body.get("grammar"):
        grammar = checked(lambda: Grammar("gbnf", body["grammar"]), "grammar")
    cont = bool(body.get("continue_final_message"))
    req = Request(
        messages=messages,
        sampling=sampling,
        max_new_tokens=limit or max_new_default,
        stop_strings=stop,
        stop_on_capacity=limit is None,  # no limit asked: stop when the cache is full
        arrival=tracing.now(),
        add_generation_prompt=_or(body, "add_generation_prompt", not cont),
        continue_final_message=cont,
        ignore_eos=bool(body.get("ignore_eos")),
        logprobs=logprobs,
        top_logprobs=top or 0,
        overflow=overflow,
        grammar=grammar,
        **tools,
    )
    n = _or(body, "n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"'n' must be between 1 and {MAX_CHOICES}", param="n")
    options = body.get("stream_options") or {}
    return req, {"stream": bool(body.get("stream")), "usage": bool(options.get("include_usage")), "n": n}


# --- Request -> a request body (the client) --------------------------------------------------------------
def chat_body(req: Request, model_id: str, kvchat_server: bool) -> dict:
    """A streamed chat-completions body for `req`; extensions (vLLM's, SGLang's, llama-server's, kvchat's)
    only when asked: OpenAI's own API refuses them. `kvchat_server`: the server is kvchat's (overflow)."""
    s = req.sampling
    body = {
        "model": model_id,
        "messages": wire_messages(req.messages),
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": req.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
    }
    for name, value, off in (
        ("top_k", s.top_k, 0),
        ("min_p", s.min_p, 0.0),
        ("repetition_penalty", s.repetition_penalty, 1.0),
        ("seed", s.seed, None),
    ):
        if value != off:
            body[name] = value
    if req.stop_strings:
        body["stop"] = list(req.stop_strings)
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.logprobs:  # OpenAI's own fields: vLLM, SGLang, llama-server and kvchat answer them
        body.update(logprobs=True, top_logprobs=req.top_logprobs)
    if req.continue_final_message:  # vLLM's and kvchat's names; llama-server continues a last assistant turn
        body.update(continue_final_message=True, add_generation_prompt=False)
    if req.overflow != "stop" and kvchat_server:
        body["overflow"] = req.overflow  # kvchat's own: another server keeps its own rule for a long prompt
    body.update(grammar_fields(req.grammar))
    body.update(offered_tools(req))
    return body


def grammar_fields(grammar: Grammar | None) -> dict:
    """A grammar as a server takes it: `response_format` for JSON (OpenAI's, and vLLM's, SGLang's, llama-server's,
    Ollama's /v1, kvchat's), `grammar` for GBNF (llama-server's name; kvchat takes it too); a Lark grammar is the
    local engine's alone (refused before this)."""
    if grammar is None:
        return {}
    if grammar.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if grammar.kind == "json_schema":
        schema = json.loads(grammar.source)
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}}
    return {"grammar": grammar.source}


# --- a reply -> the response's words (the server) ---------------------------------------------------------
def _token_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def logprobs_content(steps, token_ids, masks=()) -> list[dict]:
    """Steps (StepLogprobs) of the tokens `token_ids` in OpenAI's shape, `logprobs.content`: each token's raw
    log-probability and its top alternatives; kvchat's own figures (the sampled distribution's, the entropy,
    the rank, the ids and, with a grammar, what it did at the step: `masks`, MaskStep) beside them."""
    out = []
    masks = list(masks) or [None] * len(steps)
    for s, token_id, mask in zip(steps, token_ids, masks):
        entry = _token_entry(s.text, s.logprob)
        entry["top_logprobs"] = [_token_entry(a.text, a.logprob) for a in s.top]
        entry[EXTENSION] = {
            "sampled_logprob": s.sampled_logprob,
            "entropy": s.entropy,
            "sampled_entropy": s.sampled_entropy,
            "rank": s.rank,
            "token_id": token_id,
            "top": [{"token_id": a.token_id, "sampled_logprob": a.sampled_logprob} for a in s.top],
        }
        if mask is not None:
            entry[EXTENSION]["grammar"] = mask.to_dict()
        out.append(entry)
    return out


def reply_logprobs(request: Request, steps, token_ids, masks=()) -> dict | None:
    """A choice's `logprobs`: None unless the request asked for them."""
    if not request.logprobs:
        return None
    return {"content": logprobs_content(steps, token_ids, masks), "refusal": None}


def report(ev: Finished | Failed, prompt_tokens: int) -> tuple[dict, dict]:
    """`usage` and the `kvchat` report of a request's last event."""
    if isinstance(ev, Finished):
        cache = {k: v for k, v in ev.cache.items() if k != "store"}
        out = {REUSE: ev.reuse.to_dict(), TRACE: ev.trace, CACHE: cache, STORE: ev.cache.get("store")}
        completion, cached = len(ev.token_ids), ev.reuse.reused
    else:
        out, completion, cached = {TRACE: ev.trace, ERROR: ev.error}, 0, 0
    out[PROMPT_TOKENS] = prompt_tokens
    drafted = (out[TRACE] or {}).get("speculative")
    if drafted:  # llama.cpp's names for a reply's drafts (its server's `timings`)
        out["draft_n"], out["draft_n_accepted"] = drafted["drafted"], drafted["accepted"]
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return usage, out


def choice_of(index: int, request: Request, last: Finished) -> dict:
    """One choice of a whole (not streamed) reply: its message (its calls, where it made any), log-probabilities
    and why it stopped."""
    message = {"role": "assistant", "content": last.text}
    if last.tool_calls:
        message.update(content=last.text or None, tool_calls=call_list(last.tool_calls))
    return {
        "index": index,
        "message": message,
        "logprobs": reply_logprobs(request, last.logprobs, last.token_ids, last.grammar),
        "finish_reason": finish_reason(last),
    }


def finish_reason(last: Finished) -> str:
    """OpenAI's finish_reason of a reply: tool_calls where it made calls, else its stop reason's."""
    return "tool_calls" if last.tool_calls else FINISH_REASONS.get(last.reason, "stop")


def chunk(meta: dict, delta: dict, finish=None, logprobs=None, index: int = 0, **extra) -> dict:
    """One `chat.completion.chunk` of a stream, for one choice (`index`)."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {**meta, "object": "chat.completion.chunk", "choices": [choice], **extra}


def sse(obj) -> str:
    """One server-sent event."""
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


# --- the response's words -> the engine's records (the client) -----------------------------------------
def _num(d: dict, key: str) -> float | None:
    v = d.get(key)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def step_from(entry: dict) -> StepLogprobs | None:
    """One entry of a response's `logprobs.content` (kvchat's own figures where a kvchat server sent them
    beside it); None when it is not one."""
    if not isinstance(entry, dict) or _num(entry, "logprob") is None:
        return None
    mine = entry.get(EXTENSION) if isinstance(entry.get(EXTENSION), dict) else {}
    theirs = mine.get("top") if isinstance(mine.get("top"), list) else []
    theirs = [x if isinstance(x, dict) else {} for x in theirs]
    top = []
    for j, a in enumerate(x for x in entry.get("top_logprobs") or () if isinstance(x, dict)):
        if _num(a, "logprob") is not None:
            extra = theirs[j] if j < len(theirs) else {}
            token_id = extra.get("token_id") if type(extra.get("token_id")) is int else -1
            top.append(Alternative(token_id, str(a.get("token", "")), a["logprob"], _num(extra, "sampled_logprob")))
    rank = mine.get("rank") if type(mine.get("rank")) is int else None
    return StepLogprobs(
        str(entry.get("token", "")),
        entry["logprob"],
        _num(mine, "sampled_logprob"),
        _num(mine, "entropy"),
        _num(mine, "sampled_entropy"),
        rank,
        tuple(top),
    )


def reuse_from(d: dict) -> ReuseReport:
    """A reuse report as a kvchat server sent it (ReuseReport.to_dict), unknown keys left out."""
    names = {f.name for f in dataclasses.fields(ReuseReport)}
    return ReuseReport(**{k: v for k, v in d.items() if k in names})
