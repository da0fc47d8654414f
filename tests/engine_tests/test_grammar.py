"""Structured output (engine.grammar): a grammar — a JSON schema, any JSON object, Lark or GBNF — decides which
tokens may come next, so a reply always parses, on a random-weight model too: the grammar makes it valid, not the
model. What the grammar did at each step is kept (the tokens it allowed, the probability it removed, the token the
model preferred where it forbade it), and the reply's trace sums it."""

import json

import jsonschema
import pytest

from engine.errors import EngineError
from engine.events import Finished, Token
from engine.grammar import Grammar
from engine.session import Request, Session
from engine.weights.loading import load_model

SCHEMAS = [  # nested objects, arrays, enums, numbers with bounds and steps, required fields
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
     "additionalProperties": False},
    {"type": "object", "properties": {"nights": {"type": "integer", "minimum": 1, "maximum": 14}},
     "required": ["nights"], "additionalProperties": False},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000,
                                                              "multipleOf": 0.01}},
     "required": ["price"], "additionalProperties": False},
    {"type": "object", "properties": {"mode": {"enum": ["train", "plane", "bus"]}}, "required": ["mode"],
     "additionalProperties": False},
    {"type": "object", "properties": {"stops": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                "minItems": 1, "maxItems": 3}},
     "required": ["stops"], "additionalProperties": False},
    {"type": "object", "properties": {"trip": {"type": "object", "properties": {
        "from": {"type": "string", "maxLength": 10}, "to": {"type": "string", "maxLength": 10}},
        "required": ["from", "to"], "additionalProperties": False}}, "required": ["trip"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"],
                                                                          "maxLength": 16}},
     "required": ["ok", "note"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"days": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "plan": {"enum": ["walk", "eat"]}},
        "required": ["day", "plan"], "additionalProperties": False}}}, "required": ["days"],
     "additionalProperties": False},
    {"type": "object", "properties": {"budget": {"type": "integer", "minimum": 100, "maximum": 999},
                                      "currency": {"const": "CNY"},
                                      "rating": {"type": "number", "minimum": 0, "maximum": 5,
                                                 "multipleOf": 0.5}},
     "required": ["budget", "currency", "rating"], "additionalProperties": False},
]  # fmt: skip


@pytest.fixture(scope="module")
def model(llama_dir):
    return load_model(llama_dir, device="cpu", dtype="float32")


def test_ten_schemas_through_the_official_client_every_reply_validates(llama_dir, tmp_path):
    """`engine serve` on a random-weight model, the official `openai` client, response_format json_schema for ten
    schemas and json_object: every reply parses and validates (jsonschema), each its reply's report of what the
    grammar did; sampled replies too."""
    openai = pytest.importorskip("openai")
    from servers import engine_serve

    server = engine_serve(tmp_path, "--model", str(llama_dir))
    try:
        api = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
        for i, schema in enumerate(SCHEMAS):
            for temperature in (0.0, 1.0):
                r = api.chat.completions.create(
                    model=llama_dir.name, messages=[{"role": "user", "content": f"trip {i}"}], max_tokens=200,
                    temperature=temperature, seed=i,
                    response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}},
                )  # fmt: skip
                text = r.choices[0].message.content
                jsonschema.validate(json.loads(text), schema)
                grammar = r.model_extra["kvchat"]["trace"]["grammar"]
                assert grammar["kind"] == "json_schema" and grammar["steps"] == r.usage.completion_tokens
                assert r.choices[0].finish_reason == "stop"
        stopped = 0
        for seed in range(4):  # any object: a string may run on (a random model), cut at max_tokens as OpenAI does
            r = api.chat.completions.create(model=llama_dir.name, messages=[{"role": "user", "content": "any"}],
                                            max_tokens=200, temperature=1.0, seed=seed,
                                            response_format={"type": "json_object"})  # fmt: skip
            text = r.choices[0].message.content
            if r.choices[0].finish_reason == "stop":
                assert isinstance(json.loads(text), dict)
                stopped += 1
            else:
                assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 200
                assert text.startswith("{")
        print("json_object replies that closed:", stopped)
        _per_token_stream_gbnf_and_remote(api, server, llama_dir.name)
    finally:
        server.stop()


def _per_token_stream_gbnf_and_remote(api, server, name):
    """With logprobs each token's `kvchat` entry says what the grammar did, streamed and not, the same figures;
    llama-server's `grammar` field (GBNF) is taken; a wrong one is a 400 naming it; and the app's remote engine
    sends a conversation's format through (response_format, grammar) and refuses Lark before sending."""
    from engine.http.remote import RemoteSession, RemoteSpec

    schema = SCHEMAS[3]
    fmt = {"type": "json_schema", "json_schema": {"name": "m", "schema": schema}}
    ask = dict(model=name, messages=[{"role": "user", "content": "how?"}], max_tokens=64, logprobs=True,
               response_format=fmt)  # fmt: skip
    whole = api.chat.completions.create(**ask)
    entries = [e.model_extra["kvchat"]["grammar"] for e in whole.choices[0].logprobs.content]
    assert len(entries) == whole.usage.completion_tokens and entries[0]["allowed"] < 5
    streamed, usage = [], None
    for part in api.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}):
        usage = part.usage or usage
        if part.choices and part.choices[0].logprobs:
            streamed += [e.model_extra["kvchat"]["grammar"] for e in part.choices[0].logprobs.content]
    assert len(streamed) == usage.completion_tokens
    # greedy: the same figures (to float rounding: the second run reuses the prompt's cached positions), up to
    # where a near tie of a random model's logits might go the other way
    for a, b in list(zip(streamed, entries))[:8]:
        assert (a["allowed"], a["preferred"]) == (b["allowed"], b["preferred"])
        assert a["removed"] == pytest.approx(b["removed"], abs=1e-6)
    r = api.chat.completions.create(model=name, messages=[{"role": "user", "content": "?"}], max_tokens=8,
                                    extra_body={"grammar": 'root ::= "on" | "off"'})  # fmt: skip
    assert r.choices[0].message.content in ("on", "off")
    import openai

    with pytest.raises(openai.BadRequestError, match="does not compile") as e:
        api.chat.completions.create(model=name, messages=[{"role": "user", "content": "?"}], max_tokens=8,
                                    extra_body={"grammar": "root ::= (("})  # fmt: skip
    assert e.value.body["param"] == "grammar"
    remote = RemoteSession(RemoteSpec(server.url))
    remote.connect()
    try:
        msgs = [{"role": "user", "content": "go"}]
        for grammar, check in ((Grammar.json_schema(schema), lambda t: jsonschema.validate(json.loads(t), schema)),
                               (Grammar("gbnf", 'root ::= "a" | "b"'), lambda t: t in ("a", "b"))):  # fmt: skip
            last = list(remote.generate(Request(messages=msgs, max_new_tokens=64, grammar=grammar)))[-1]
            assert isinstance(last, Finished), last
            assert check(last.text) is not False and last.trace["server"]["grammar"]["kind"] == grammar.kind
        last = list(remote.generate(Request(messages=msgs, max_new_tokens=8, grammar=Grammar("lark", 'start: "a"'))))
        assert last[-1].error == "a Lark grammar needs the local engine: servers take a JSON schema or GBNF"
    finally:
        remote.close()


def test_each_token_says_what_the_grammar_allowed_removed_and_overrode(model):
    """Every token's MaskStep: how many tokens were allowed (the grammar's first step allows only what starts the
    value), the probability the grammar removed (0 to 1), the model's preferred token where it was forbidden; the
    trace's summary is their mean and count; the raw log-probability is the model's, the sampled one after the
    mask."""
    req = Request(prompt_ids=(5, 6, 7, 8), max_new_tokens=64, logprobs=True, top_logprobs=2,
                  grammar=Grammar.json_schema(SCHEMAS[3]))  # fmt: skip
    events = list(Session(model).generate(req))
    fin = events[-1]
    tokens = [e for e in events if isinstance(e, Token)]
    assert isinstance(fin, Finished) and json.loads(fin.text)["mode"] in ("train", "plane", "bus")
    steps = [t.grammar for t in tokens]
    assert all(s is not None and 1 <= s.allowed <= s.vocab and 0.0 <= s.removed <= 1.0 for s in steps)
    assert steps[0].allowed < 5  # `{` and little else opens the object
    g = fin.trace["grammar"]
    assert g["steps"] == len(tokens) and g["overridden"] == sum(s.preferred is not None for s in steps)
    assert g["mean_removed"] == pytest.approx(sum(s.removed for s in steps) / len(steps))
    assert g["mask_us"] > 0 and fin.reason in ("grammar", "eos")
    for t, s in zip(tokens, steps):
        if s.preferred is not None:
            assert s.preferred != t.token_id and t.logprobs.logprob <= t.logprobs.top[0].logprob
        assert t.logprobs.sampled_logprob == 0.0  # greedy: drawn from a point mass among the allowed


@pytest.mark.parametrize("kind,text", [
    ("lark", 'start: "yes" | "no" | "maybe"'),
    ("gbnf", 'root ::= "yes" | "no" | "maybe"'),
])  # fmt: skip
def test_a_lark_or_gbnf_grammar_decides_the_reply(model, tmp_path, kind, text):
    path = tmp_path / f"g.{kind}"
    path.write_text(text)
    grammar = Grammar.from_file(path)
    assert grammar.kind == kind
    for seed in range(3):
        from engine.sampling import SamplingParams

        req = Request(prompt_ids=(5, 6, 7), max_new_tokens=16, grammar=grammar,
                      sampling=SamplingParams(temperature=1.0, seed=seed))  # fmt: skip
        fin = list(Session(model).generate(req))[-1]
        assert fin.text in ("yes", "no", "maybe"), fin.text


def test_a_grammar_that_does_not_compile_is_refused_before_anything_runs(model, tmp_path):
    with pytest.raises(EngineError, match="does not compile: Invalid type: nonsense"):
        Grammar.json_schema({"type": "nonsense"}).check()
    with pytest.raises(EngineError, match="unknown name"):
        Grammar("lark", "start: x").check()
    big = tmp_path / "big.json"
    big.write_text(" " * (2 << 20))
    with pytest.raises(EngineError, match="larger than"):
        Grammar.from_file(big)
    req = Request(prompt_ids=(5, 6), max_new_tokens=8, grammar=Grammar("lark", "start: x"))
    events = list(Session(model).generate(req))
    assert events[-1].error.startswith("the Lark grammar (1 line) does not compile")


def test_generate_and_chat_take_a_schema_or_grammar_file(llama_dir, tmp_path):
    """`generate --json-schema FILE` prints a reply the schema validates and the grammar's line after it; `--grammar`
    takes Lark or GBNF; `chat` keeps the grammar each turn; a grammar that does not compile is a usage error (exit 2)
    before any model loads, in the library's words."""
    import subprocess
    import sys

    def run(*args, stdin=None):
        argv = [sys.executable, "-m", "engine", *map(str, args)]
        return subprocess.run(argv, capture_output=True, text=True, timeout=600, input=stdin)

    schema = tmp_path / "trip.json"
    schema.write_text(json.dumps(SCHEMAS[1]))
    r = run("generate", "--model", llama_dir, "--prompt", "How long?", "--max-new-tokens", 64, "--json-schema", schema)
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), SCHEMAS[1])
    assert "grammar: JSON schema · " in r.stderr and "µs of it waited for" in r.stderr
    out = json.loads(run("generate", "--model", llama_dir, "--prompt", "?", "--max-new-tokens", 64, "--json",
                         "--json-schema", schema).stdout)  # fmt: skip
    g = out["trace"]["grammar"]
    assert out["stop_reason"] in ("grammar", "eos") and g["steps"] == len(out["token_ids"])
    assert 0 <= g["wait_us"] <= g["mask_us"]  # what the step waited for is a part of the mask's time
    gbnf = tmp_path / "yn.gbnf"
    gbnf.write_text('root ::= "yes" | "no"\n')
    r = run("chat", "--model", llama_dir, "--grammar", gbnf, "--max-new-tokens", 8, stdin="first\nsecond\n/quit\n")
    assert r.returncode == 0, r.stderr
    assert [line.split("assistant> ")[1] for line in r.stdout.splitlines() if "assistant> " in line][:2] in (
        [a, b] for a in ("yes", "no") for b in ("yes", "no"))  # fmt: skip
    bad = tmp_path / "bad.lark"
    bad.write_text("start: x\n")
    r = run("generate", "--model", llama_dir, "--prompt", "x", "--grammar", bad)
    assert r.returncode == 2 and "argument --grammar: the Lark grammar (1 line) does not compile" in r.stderr
    assert "loading" not in r.stderr
