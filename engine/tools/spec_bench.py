"""`python -m engine bench --speculative int4,lookup`: speculative decoding against the model alone, in the same run.

Three tasks, each a chat prompt run to --new-tokens greedily: free text, an "edit this text" task (a paragraph to
return with its typos fixed) and a "rewrite this code" task (a function with a name changed) — where lookup finds
its drafts. For each task the model alone and each kind of draft run alternately, --rounds times; a row reports the
median decode tok/s, its ratio to the model alone's median in the same run, the acceptance overall and by draft
position, and whether the tokens equal the model's alone (they must: greedy). llama.cpp's prompt-lookup decoding
(llama-cpp-python's LlamaPromptLookupDecoding) runs the same tasks on the same GGUF file, in a child process, where
it is installed; a draft that cannot draft here (an int4 copy of a file already 4-bit) is a row with its reason.
--precisions picks the target's: a GGUF file as written (file) or on int8 activations (file/a8: llama.cpp's own
arithmetic: its verify rows cost about 60% of float32's), a checkpoint in float32, bfloat16 or kvchat's rows.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

TEXT = "Tell me about the history of Paris, in a few paragraphs."
EDIT = (
    "Return this text whole with its typos fixed, changing nothing else:\n\n"
    "The cache keeps the keys and values of every positon the model has seen, so that a new token only computes "
    "its own. When a person edits an erlier message, every position after the edit is thrown away and computed "
    "again; the positions before it are kept. The panel shows how many were kept, how many were recomputed, and "
    "the first position that changed. A longer conversation needs a bigger cache, and the cache grows with the "
    "number of layers, the number of key-value heads and the width of each head."
)
REWRITE = (
    "Rewrite this Python code with `prices` renamed to `amounts`, changing nothing else:\n\n"
    "def total(prices, tax):\n    result = 0\n    for p in prices:\n        result = result + p * (1 + tax)\n"
    "    return result\n\n\ndef average(prices):\n    if not prices:\n        return 0\n"
    "    return sum(prices) / len(prices)\n\n\ndef cheapest(prices):\n    best = None\n    for p in prices:\n"
    "        if best is None or p < best:\n            best = p\n    return best\n"
)
TASKS = {"text": TEXT, "edit": EDIT, "rewrite": REWRITE}


def _reply(session, prompt: str, new_tokens: int, kind: str | None, k: int):
    from ..events import Failed, Finished
    from ..request import Request

    req = Request(messages=[{"role": "user", "content": prompt}], max_new_tokens=new_tokens, speculative=kind,
                  draft_tokens=k)  # fmt: skip
    session.reset()  # every reply prefills its prompt alike: the model alone and each draft start from the same logits
    events = list(session.generate(req))
    last = events[-1]
    if isinstance(last, Failed):
        raise RuntimeError(last.error)
    assert isinstance(last, Finished)
    return last


def _llama_lookup(gguf: str, prompts: dict, new_tokens: int, threads: int, rounds: int, k: int) -> dict:
    """llama.cpp's prompt-lookup decoding and its plain decode on the same file: decode tok/s per task (a child
    process: run_isolated)."""
    import time

    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    out = {}
    for name, lookup in (("llama.cpp", None), ("llama.cpp lookup", LlamaPromptLookupDecoding(num_pred_tokens=k))):
        llm = Llama(gguf, n_ctx=2048, n_threads=threads, verbose=False, draft_model=lookup)
        rows = {}
        for task, prompt in prompts.items():
            rates = []
            for _ in range(rounds):
                t0, first, n = time.perf_counter(), None, 0
                stream = llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=new_tokens,
                                                    temperature=0.0, stream=True)  # fmt: skip
                for part in stream:
                    if part["choices"][0]["delta"].get("content"):
                        n += 1
                        first = first or time.perf_counter()
                end = time.perf_counter()
                rates.append((n - 1) / (end - first) if first and n > 1 else None)
                del t0
            good = [r for r in rates if r]
            rows[task] = round(statistics.median(good), 2) if good else None
        out[name] = rows
        del llm
    return out


def _targets(ns, path: str) -> list[str]:
    """The target's precisions (--precisions): a GGUF file as it is (file) or on int8 activations (file/a8, as
    llama.cpp multiplies); a checkpoint in float32, bfloat16 or kvchat's int8/int4 rows. Default: file, float32."""
    from .bench.rows import FILE_ACTIVATIONS, QUANT

    gguf = path.endswith(".gguf")
    known = list(FILE_ACTIVATIONS) if gguf else ["float32", "bfloat16", *QUANT]
    asked = [p.strip() for p in ns.precisions.split(",") if p.strip()] if ns.precisions else [known[0]]
    bad = [p for p in asked if p not in known]
    if bad:
        raise SystemExit(
            f"error: --precisions {', '.join(bad)}: with --speculative this model runs as {', '.join(known)}"
        )
    return asked


def _tasks(session, kinds: list[str], new: int, k: int, rounds: int) -> list[dict]:
    """Each task's rows for one target: the model alone, then each kind of draft, run alternately `rounds` times."""
    rows = []
    for task, prompt in TASKS.items():
        alone_rates, alone_ids = [], None
        spec = {kind: {"rates": [], "last": None, "error": None} for kind in kinds}
        for _ in range(rounds):
            try:
                fin = _reply(session, prompt, new, None, k)
            except RuntimeError as e:  # the model cannot run the task (its prompt past the context): rows say why
                rows += [{"task": task, "draft": d, "error": f"{e}"} for d in ("none", *kinds)]
                break
            alone_rates.append(fin.trace["decode_tok_s"])
            alone_ids = fin.token_ids
            for kind in kinds:
                if spec[kind]["error"]:
                    continue
                try:
                    got = _reply(session, prompt, new, kind, k)
                except Exception as e:  # a draft that cannot draft here: its row says why
                    spec[kind]["error"] = f"{type(e).__name__}: {e}"
                    continue
                spec[kind]["rates"].append(got.trace["decode_tok_s"])
                spec[kind]["last"] = got
        if not alone_rates:
            continue
        base = statistics.median(r for r in alone_rates if r)
        rows.append({"task": task, "draft": "none", "decode_tok_s": round(base, 2), "ratio": 1.0,
                     "tokens": len(alone_ids)})  # fmt: skip
        for kind, got in spec.items():
            if got["error"]:
                rows.append({"task": task, "draft": kind, "error": got["error"]})
                continue
            rate = statistics.median(r for r in got["rates"] if r)
            s = got["last"].trace["speculative"]
            rows.append({
                "task": task, "draft": kind, "decode_tok_s": round(rate, 2), "ratio": round(rate / base, 3),
                "acceptance": s["acceptance"], "by_position": s["acceptance_by_position"],
                "same_tokens": got["last"].token_ids == alone_ids, "tokens": len(got["last"].token_ids),
            })  # fmt: skip
    return rows


def run(ns) -> int:
    from ..devices import default_threads
    from ..drafters import check_kind
    from ..session import Session
    from ..weights.loading import load_model
    from .bench.isolation import run_isolated
    from .bench.machine import cpu_info
    from .bench.rows import load_options
    from .bench.shapes import write_random_checkpoint

    kinds = [k.strip() for k in ns.speculative.split(",") if k.strip()]
    for kind in kinds:
        check_kind(kind)
    threads = ns.threads or default_threads()
    k, new, rounds = ns.draft_tokens, ns.new_tokens, ns.rounds
    with tempfile.TemporaryDirectory() as tmp:
        path = ns.model or str(write_random_checkpoint(Path(tmp) / ns.shape, ns.shape))
        rows = []
        for precision in _targets(ns, str(path)):
            mode, group, activations, dtype = load_options(precision)
            target = load_model(path, dtype=dtype, weights=mode, group_size=group, activations=activations)
            session = Session(target, cache_budget=0)
            rows += [dict(r, target=precision) for r in _tasks(session, kinds, new, k, rounds)]
            del session, target  # one target's weights at a time
        reference = {"error": "not run: the model is not a GGUF file (llama.cpp reads GGUF)"}
        if str(path).endswith(".gguf"):
            try:
                import llama_cpp  # noqa: F401

                reference = run_isolated(_llama_lookup, (path, TASKS, new, threads, rounds, k))
            except ImportError as e:
                reference = {"error": f"not run: llama-cpp-python is not installed ({e})"}
    report = {"model": Path(path).name if ns.model else ns.shape, "cpu": cpu_info(), "threads": threads,
              "draft_tokens": k, "new_tokens": new, "rounds": rounds, "rows": rows, "llama.cpp": reference}  # fmt: skip
    if isinstance(reference, dict) and "llama.cpp lookup" in reference:
        for r in rows:
            theirs = reference["llama.cpp lookup"].get(r["task"])
            if r.get("draft") == "lookup" and theirs and r.get("decode_tok_s"):
                r["vs_llama_cpp_lookup"] = round(r["decode_tok_s"] / theirs, 3)
    if ns.json:
        print(json.dumps(report, indent=2))
        return 0
    cpu = report["cpu"] or {}
    print(f"{report['model']} · {cpu.get('model', '')} · {threads} threads · {new} new tokens, {k} drafted a round, "
          f"{rounds} rounds")  # fmt: skip
    print("target   task     draft     decode tok/s  × alone  accepted  by position              same  vs llama.cpp "
          "lookup")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['target']:8s} {r['task']:8s} {r['draft']:8s}  {r['error']}")
            continue
        by = " ".join("—" if x is None else f"{x:.0%}" for x in r.get("by_position") or [])
        acc = "" if r.get("acceptance") is None else f"{r['acceptance']:.0%}"
        same = "" if "same_tokens" not in r else ("yes" if r["same_tokens"] else "NO")
        vs = f"{r['vs_llama_cpp_lookup']:.2f}×" if r.get("vs_llama_cpp_lookup") else ""
        print(f"{r['target']:8s} {r['task']:8s} {r['draft']:8s}  {r['decode_tok_s']:12.1f}  {r['ratio']:6.2f}×  "
              f"{acc:>8s}  {by:23s}  {same:4s}  {vs}")  # fmt: skip
    if isinstance(reference, dict) and reference.get("error"):
        print(f"llama.cpp: {reference['error']}")
    return 0
