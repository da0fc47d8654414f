"""`python -m engine bench --structured`: decode with a JSON schema against decode without, in the same run.

Each schema's prompt is run to --new-tokens greedily, with the schema and without it (the same prompt: the model
writes JSON of its own accord, unconstrained), alternately, --rounds times. A row reports the median decode tok/s,
its ratio to the unconstrained median, the grammar's mask time per token and the part of it the step waited for
(the rest ran beside the forward pass), and whether the reply parses. llama.cpp's GBNF from the same schema
(llama-cpp-python's LlamaGrammar.from_json_schema) runs the same prompts on the same GGUF file, in a child process,
where it is installed: its own ratio, for scale.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

SCHEMAS = {
    "flat": {"type": "object", "properties": {
        "city": {"type": "string"}, "country": {"type": "string"}, "nights": {"type": "integer"},
        "budget": {"type": "integer", "minimum": 0}, "notes": {"type": "string"}},
        "required": ["city", "country", "nights", "budget", "notes"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"trip": {"type": "object", "properties": {
        "days": {"type": "array", "items": {"type": "object", "properties": {
            "day": {"type": "integer", "minimum": 1}, "plan": {"type": "string"},
            "meals": {"type": "array", "items": {"enum": ["breakfast", "lunch", "dinner"]}}},
            "required": ["day", "plan", "meals"], "additionalProperties": False}}},
        "required": ["days"], "additionalProperties": False}}, "required": ["trip"], "additionalProperties": False},
    "any object": None,
}  # fmt: skip
PROMPT = "Plan a week in Paris as JSON: for each day, what to do and which meals are planned."


def _schema_prompt(schema) -> str:
    return PROMPT + ("" if schema is None else "\nThe JSON schema:\n" + json.dumps(schema))


def _reply(session, prompt: str, new_tokens: int, grammar):
    from ..events import Failed
    from ..request import Request

    req = Request(messages=[{"role": "user", "content": prompt}], max_new_tokens=new_tokens, grammar=grammar)
    last = list(session.generate(req))[-1]
    if isinstance(last, Failed):
        raise RuntimeError(last.error)
    return last


def _llama_grammar(gguf: str, schemas: dict, new_tokens: int, threads: int, rounds: int) -> dict:
    """llama.cpp on the same file, each schema as its GBNF and without: decode tok/s (a child process)."""
    from llama_cpp import Llama, LlamaGrammar

    llm = Llama(gguf, n_ctx=2048, n_threads=threads, verbose=False)
    out = {}
    for name, schema in schemas.items():
        grammar = LlamaGrammar.from_json_schema(json.dumps(schema or {"type": "object"}), verbose=False)
        rates: dict = {"none": [], "schema": []}
        for _ in range(rounds):
            for which, g in (("none", None), ("schema", grammar)):
                first, n = None, 0
                messages = [{"role": "user", "content": _schema_prompt(schema)}]
                stream = llm.create_chat_completion(messages, max_tokens=new_tokens, temperature=0.0, stream=True,
                                                    grammar=g)  # fmt: skip
                for part in stream:
                    if part["choices"][0]["delta"].get("content"):
                        n += 1
                        first = first or time.perf_counter()
                end = time.perf_counter()
                if first and n > 1:
                    rates[which].append((n - 1) / (end - first))
        none, with_schema = (statistics.median(r) if r else None for r in (rates["none"], rates["schema"]))
        out[name] = {"none": none, "schema": with_schema,
                     "ratio": round(with_schema / none, 3) if none and with_schema else None}  # fmt: skip
    return out


def run(ns) -> int:
    from ..devices import default_threads
    from ..grammar import Grammar
    from ..session import Session
    from ..weights.loading import load_model
    from .bench.isolation import run_isolated
    from .bench.machine import cpu_info
    from .bench.shapes import write_random_checkpoint

    threads = ns.threads or default_threads()
    new, rounds = ns.new_tokens, ns.rounds
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = ns.model or str(write_random_checkpoint(Path(tmp) / ns.shape, ns.shape))
        session = Session(load_model(path), cache_budget=0)
        for name, schema in SCHEMAS.items():
            grammar = Grammar.json_object() if schema is None else Grammar.json_schema(schema)
            prompt = _schema_prompt(schema)
            plain, constrained, last = [], [], None
            for _ in range(rounds):
                plain.append(_reply(session, prompt, new, None).trace["decode_tok_s"])
                last = _reply(session, prompt, new, grammar)
                constrained.append(last.trace["decode_tok_s"])
            base = statistics.median(r for r in plain if r)
            rate = statistics.median(r for r in constrained if r)
            g = last.trace["grammar"]
            try:
                json.loads(last.text)
                parses = True
            except ValueError:
                parses = False  # cut at --new-tokens mid-value
            rows.append({"schema": name, "none_tok_s": round(base, 2), "schema_tok_s": round(rate, 2),
                         "ratio": round(rate / base, 3), "mask_us": g["mask_us"], "wait_us": g["wait_us"],
                         "tokens": len(last.token_ids), "stop": last.reason, "parses": parses,
                         "mean_removed": g["mean_removed"], "overridden": g["overridden"]})  # fmt: skip
        reference: dict = {"error": "not run: the model is not a GGUF file (llama.cpp reads GGUF)"}
        if str(path).endswith(".gguf"):
            try:
                import llama_cpp  # noqa: F401

                reference = run_isolated(_llama_grammar, (path, SCHEMAS, new, threads, rounds))
            except ImportError as e:
                reference = {"error": f"not run: llama-cpp-python is not installed ({e})"}
    report = {"model": Path(path).name if ns.model else ns.shape, "cpu": cpu_info(), "threads": threads,
              "new_tokens": new, "rounds": rounds, "rows": rows, "llama.cpp": reference}  # fmt: skip
    if ns.json:
        print(json.dumps(report, indent=2))
        return 0
    cpu = report["cpu"] or {}
    print(f"{report['model']} · {cpu.get('model', '')} · {threads} threads · {new} new tokens, {rounds} rounds")
    print("schema      none tok/s  schema tok/s  ratio  mask µs  waited µs  tokens  stop      parses  llama.cpp ratio")
    for r in rows:
        theirs = reference.get(r["schema"], {}).get("ratio") if isinstance(reference, dict) else None
        print(f"{r['schema']:10s}  {r['none_tok_s']:10.1f}  {r['schema_tok_s']:12.1f}  {r['ratio']:5.2f}  "
              f"{r['mask_us']:7.0f}  {r['wait_us']:9.0f}  {r['tokens']:6d}  {r['stop']:8s}  {str(r['parses']):6s}  "
              f"{'' if theirs is None else f'{theirs:.2f}'}")  # fmt: skip
    if isinstance(reference, dict) and reference.get("error"):
        print(f"llama.cpp: {reference['error']}")
    return 0
