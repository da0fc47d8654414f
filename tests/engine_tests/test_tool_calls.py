"""Tool calls (engine.tool_calls, engine serve): each family's format read back out of a reply, the tools shown
through the model's own template, a required or named call constrained so its arguments validate against the
tool's schema — on a random-weight model too —, streamed calls that reassemble to the whole reply's, and a
`role: "tool"` turn that goes on from the earlier positions."""

import json

import jsonschema
import pytest
from tool_templates import HERMES, LLAMA3, MISTRAL

from engine.errors import EngineError
from engine.tool_calls import FORMATS, CallFilter, parse_calls, read_choice, read_tools, template_format

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
BOOK = {"type": "function", "function": {"name": "book_train", "parameters": {
    "type": "object", "properties": {"to": {"type": "string", "maxLength": 12},
                                     "seats": {"type": "integer", "minimum": 1, "maximum": 4}},
    "required": ["to", "seats"], "additionalProperties": False}}}  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, BOOK)}


@pytest.mark.parametrize("fmt,text,content,calls", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": '
     '{"x": 1}}\n</tool_call>', "", [("a", {}), ("b", {"x": 1})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}', "", [("a", {"x": 1})]),  # cut before its tag
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
     [("get_weather", {"city": "Oslo"})]),
    ("llama3", ' {"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "", [("a", {"x": 1}),
                                                                                           ("b", {})]),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": "y"}}, {"name": "b", "arguments": {}}]', "",
     [("a", {"x": "y"}), ("b", {})]),
    ("granite", '<|tool_call|>[{"name": "a", "arguments": {"n": 2}}]', "", [("a", {"n": 2})]),
    ("phi4", 'functools[{"name": "a", "arguments": {"n": 2}}]', "", [("a", {"n": 2})]),
    ("hermes", "Just text, no call.", "Just text, no call.", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ("llama3", "{curly text}", "{curly text}", []),
])  # fmt: skip
def test_each_familys_calls_are_read_back_and_text_that_is_not_one_stays_content(fmt, text, content, calls):
    said, got = parse_calls(FORMATS[fmt], text)
    assert said == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got)


def test_the_format_is_the_one_the_template_teaches():
    assert template_format(HERMES).name == "hermes" and template_format(LLAMA3).name == "llama3"
    assert template_format(MISTRAL).name == "mistral"
    assert template_format("{{ messages }}") is None  # no tools in it: the model is offered none


def test_tools_and_tool_choice_are_checked():
    tools = read_tools([WEATHER, BOOK])
    assert [t.name for t in tools] == ["get_weather", "book_train"]
    assert read_choice(None, tools) == "auto" and read_choice(None, ()) == "none"
    assert read_choice({"type": "function", "function": {"name": "book_train"}}, tools) == "book_train"
    listless = [{"type": "function", "function": {"name": "x", "parameters": []}}]
    for bad, said in (([{"type": "function", "function": {"name": "a b"}}], "letters, digits"),
                      ([WEATHER, WEATHER], "named twice"), ([WEATHER] * 200, "at most 128"),
                      (listless, "JSON schema object")):  # fmt: skip
        with pytest.raises(EngineError, match=said):
            read_tools(bad)
    with pytest.raises(EngineError, match="not among the tools"):
        read_choice({"type": "function", "function": {"name": "fly"}}, tools)
    with pytest.raises(EngineError, match="'tools' is empty"):
        read_choice("required", ())


def test_a_streamed_reply_sends_its_content_and_holds_a_call_back():
    fmt = FORMATS["hermes"]
    pieces = ["\n", "Sure", ", ", "checking", ".", "\n<to", "ol_c", "all>\n", '{"name"', ': "a"}', "\n</tool_call>"]
    f = CallFilter(fmt, None)
    sent = "".join(f.feed(7, p) for p in pieces)
    content, calls = parse_calls(fmt, "".join(pieces))
    assert sent == content.strip() == "Sure, checking." and [c.name for c in calls] == ["a"]
    f = CallFilter(fmt, None)
    plain = ["Hello", " <b>", " world", "  "]
    sent = "".join(f.feed(7, p) for p in plain)
    assert "".join(plain).strip().startswith(sent) and sent == "Hello <b> world"
    f = CallFilter(FORMATS["mistral"], 99)  # a control token opens the calls: nothing after it is content
    assert f.feed(5, "Ok") == "Ok" and f.feed(99, "") == "" and f.feed(6, '[{"name"') == ""


def _checkpoint(tmp_path_factory, template):
    from checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tools"), "llama", chat_template=template, generation_eos=[1],
                           max_position_embeddings=2048)  # the tools' text in the prompt: ~900 tokens  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`engine serve` on a random-weight model whose template is Qwen 2.5's, with the official client."""
    openai = pytest.importorskip("openai")
    from servers import engine_serve

    model = _checkpoint(tmp_path_factory, HERMES)
    server = engine_serve(tmp_path_factory.mktemp("serve"), "--model", str(model))
    yield openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120), model.name, server
    server.stop()


def test_a_required_or_named_call_validates_against_its_tools_schema(served):
    api, name, _ = served
    ask = dict(model=name, messages=[{"role": "user", "content": "weather in Paris, and book a train"}],
               tools=[WEATHER, BOOK], max_tokens=200)  # fmt: skip
    seen = set()
    for choice in ("required", {"type": "function", "function": {"name": "book_train"}}):
        for seed in range(3):
            r = api.chat.completions.create(**ask, tool_choice=choice, temperature=1.0, seed=seed)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
            for call in c.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
                assert call.type == "function" and call.id.startswith("call_")
                seen.add(call.function.name)
            if isinstance(choice, dict):
                assert {t.function.name for t in c.message.tool_calls} == {"book_train"}
    r = api.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                    seed=5)  # fmt: skip
    assert len(r.choices[0].message.tool_calls) == 1
    print("functions called:", sorted(seen))


def test_streamed_call_deltas_reassemble_to_the_whole_reply(served):
    api, name, _ = served
    ask = dict(model=name, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER, BOOK],
               tool_choice="required", max_tokens=200, temperature=1.0, seed=1)  # fmt: skip
    whole = api.chat.completions.create(**ask).choices[0]
    content, calls, finish = "", {}, None
    for part in api.chat.completions.create(**ask, stream=True):
        if not part.choices:
            continue
        d = part.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or ():
            call = calls.setdefault(t.index, {"name": "", "arguments": ""})
            call["name"] += t.function.name or ""
            call["arguments"] += t.function.arguments or ""
        finish = part.choices[0].finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls" and content == (whole.message.content or "")
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in whole.message.tool_calls]  # fmt: skip


def test_a_tool_turn_goes_on_from_the_earlier_positions(served):
    """The call and its result appended: the prompt's positions and the call's, as the reply made them, are
    reused (the template writes the call in the reply's own layout); the reuse report says how many."""
    api, name, _ = served
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    first = api.chat.completions.create(model=name, messages=msgs, tools=[WEATHER], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=2)  # fmt: skip
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0]
    call = first.choices[0].message.tool_calls[0]
    prompt = first.usage.prompt_tokens
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]  # fmt: skip
    second = api.chat.completions.create(model=name, messages=msgs, tools=[WEATHER], max_tokens=8, temperature=0.0)
    reused = second.usage.prompt_tokens_details.cached_tokens
    reply = first.usage.completion_tokens
    assert reused >= prompt, (reused, prompt)  # every position of the first prompt
    print(f"reused {reused} of {prompt} prompt + {reply} reply positions; recomputed "
          f"{second.usage.prompt_tokens - reused}")  # fmt: skip


def test_tools_are_refused_where_the_template_takes_none_and_when_malformed(llama_dir, tmp_path):
    openai = pytest.importorskip("openai")
    from servers import engine_serve

    server = engine_serve(tmp_path, "--model", str(llama_dir))
    try:
        api = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.BadRequestError, match="chat template takes no tools") as e:
            api.chat.completions.create(model=llama_dir.name, messages=msgs, tools=[WEATHER], max_tokens=4)
        assert e.value.body["param"] == "tools"
        r = api.chat.completions.create(model=llama_dir.name, messages=msgs, tools=[WEATHER], tool_choice="none",
                                        max_tokens=4)  # fmt: skip
        assert r.choices[0].finish_reason in ("stop", "length")  # none: the tools are not offered at all
        with pytest.raises(openai.BadRequestError, match="named twice"):
            api.chat.completions.create(model=llama_dir.name, messages=msgs, tools=[WEATHER, WEATHER], max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="not among the tools") as e:
            api.chat.completions.create(model=llama_dir.name, messages=msgs, tools=[WEATHER], max_tokens=4,
                                        tool_choice={"type": "function", "function": {"name": "fly"}})  # fmt: skip
        assert e.value.body["param"] == "tool_choice"
    finally:
        server.stop()


def test_the_remote_engine_passes_tools_through_and_reads_the_calls_back(served):
    """The app's remote engine against a server that takes tools (here kvchat's): `tools` and `tool_choice` sent,
    the streamed `delta.tool_calls` put back together into the reply's calls; the call turn sent back with its
    arguments as JSON text, as OpenAI's API takes it."""
    from engine.events import Finished
    from engine.http.remote import RemoteSession, RemoteSpec
    from engine.request import Request
    from engine.sampling import SamplingParams
    from engine.tool_calls import read_tools

    _, _, server = served
    remote = RemoteSession(RemoteSpec(server.url))
    remote.connect()
    try:
        msgs = [{"role": "user", "content": "weather?"}]
        req = Request(messages=msgs, max_new_tokens=200, tools=read_tools([WEATHER, BOOK]), tool_choice="book_train",
                      parallel_tool_calls=False, sampling=SamplingParams(temperature=1.0, seed=3))  # fmt: skip
        last = list(remote.generate(req))[-1]
        assert isinstance(last, Finished) and len(last.tool_calls) == 1, last
        call = last.tool_calls[0]
        assert call.name == "book_train" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS["book_train"])
        turn = [*msgs, {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "booked"}]  # fmt: skip
        after = list(remote.generate(Request(messages=turn, max_new_tokens=4, tools=req.tools, tool_choice="auto")))
        assert isinstance(after[-1], Finished), after[-1]
        assert after[-1].reuse.reused > 0  # the server kept the positions of the prompt and the call
    finally:
        remote.close()
