"""`python -m engine info|generate|replay|chat|quality|bench|selftest`: the engine's command line."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import EngineError
from .events import Failed, Finished, PrefillStarted, Token
from .sampling import SamplingParams


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the bundled demo model)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu, cuda, mps (default: the best available)")
    p.add_argument("--capacity", type=int, default=None, help="KV cache positions (default: min(context, 4096))")
    p.add_argument("--weights", default="none", choices=["none", "int8", "int4"], help="weight precision")
    p.add_argument("--kv", default="none", choices=["none", "int8", "int4"], help="KV cache precision")
    p.add_argument("--group-size", type=int, default=64, help="values per quantization scale (0: per channel)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _sampling(ns, overrides: dict | None = None) -> SamplingParams:
    o = overrides or {}
    return SamplingParams(temperature=o.get("temperature", ns.temperature), top_k=o.get("top_k", ns.top_k),
                          top_p=o.get("top_p", ns.top_p), min_p=o.get("min_p", ns.min_p),
                          repetition_penalty=o.get("repetition_penalty", ns.repetition_penalty),
                          seed=o.get("seed", ns.seed))


def _open(ns):
    from .loader import load_model
    from .session import Session
    loaded = load_model(ns.model, device=ns.device, dtype=ns.dtype, weights=ns.weights, group_size=ns.group_size)
    return loaded, Session(loaded, capacity=ns.capacity, kv=ns.kv)


def run_request(session, req, stream_to=None) -> dict:
    """Run one request to its end; return the JSON record the command line prints."""
    result: dict = {"prompt_token_ids": None}
    for ev in session.generate(req):
        if isinstance(ev, PrefillStarted):
            result["prompt_token_ids"] = list(ev.prompt_token_ids)
            result["reuse"] = ev.reuse.to_dict()
        elif isinstance(ev, Token) and stream_to is not None:
            stream_to.write(ev.text)
            stream_to.flush()
        elif isinstance(ev, Finished):
            if stream_to is not None:
                stream_to.write(ev.tail + "\n")
            t = ev.trace
            result.update(text=ev.text, token_ids=list(ev.token_ids), stop_reason=ev.reason,
                          trace={k: t[k] for k in ("ttft_ms", "tpot_ms", "tokens", "decode_tok_s", "prefill_ms",
                                                   "prefill_tok_s", "e2e_ms", "mean_ms_per_token_incl_wait",
                                                   "ttft_queue_ms", "ttft_tokenize_ms", "ttft_prefill_ms",
                                                   "ttft_first_token_ms")},
                          reuse=ev.reuse.to_dict(), cache=ev.cache)
        elif isinstance(ev, Failed):
            result.update(error=ev.error, error_kind=ev.kind, stop_reason=None, trace=ev.trace,
                          cache=session.cache_stats())
    return result


def _messages(system, user_text):
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": user_text}]


def cmd_info(ns) -> int:
    loaded, session = _open(ns)
    facts = loaded.facts()
    facts["capacity"] = session.cache.capacity
    facts["kv_cache"] = session.kv
    facts["kv_bytes_per_position"] = session.cache.bytes_per_position
    facts["kv_allocated_bytes"] = session.cache.allocated_bytes
    facts["chat_template"] = loaded.tokenizer.has_chat_template
    facts["stop_token_ids"] = sorted(loaded.tokenizer.stop_ids)
    if ns.json:
        print(json.dumps(facts, indent=2))
    else:
        for k, v in facts.items():
            print(f"{k:26s} {v}")
    return 0


def cmd_generate(ns) -> int:
    from .session import Request
    loaded, session = _open(ns)
    if ns.raw:
        req = Request(prompt=ns.prompt, sampling=_sampling(ns), max_new_tokens=ns.max_new_tokens)
    else:
        req = Request(messages=_messages(ns.system, ns.prompt), sampling=_sampling(ns),
                      max_new_tokens=ns.max_new_tokens)
    result = run_request(session, req, stream_to=None if ns.json else sys.stdout)
    if ns.json:
        print(json.dumps(result, ensure_ascii=False))
    elif "error" not in result:
        t = result["trace"]
        tpot = "—" if t["tpot_ms"] is None else f"{t['tpot_ms']:.1f} ms"
        print(f"[{result['stop_reason']}] {t['tokens']} tokens · TTFT {t['ttft_ms']:.1f} ms · TPOT {tpot} · "
              f"cache {result['cache']['positions']}/{result['cache']['capacity']}", file=sys.stderr)
    if "error" in result:
        print(f"error: {result['error']}", file=sys.stderr)
        return 1
    return 0


def cmd_replay(ns) -> int:
    from .session import Request
    try:
        with open(ns.script, encoding="utf-8") as f:
            steps = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: cannot read the script {ns.script}: {e}", file=sys.stderr)
        return 2
    if not isinstance(steps, list):
        print(f"error: {ns.script} must hold a JSON list of steps", file=sys.stderr)
        return 2
    loaded, session = _open(ns)
    failed = 0
    for i, step in enumerate(steps):
        overrides = {k: step[k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
                     if k in step}
        common = dict(sampling=_sampling(ns, overrides), max_new_tokens=step.get("max_new_tokens", ns.max_new_tokens))
        if "messages" in step:
            req = Request(messages=step["messages"], **common)
        elif "prompt" in step:
            req = Request(prompt=step["prompt"], **common)
        else:
            print(f"error: step {i} has neither messages nor prompt", file=sys.stderr)
            return 2
        result = run_request(session, req)
        failed += "error" in result
        if ns.json:
            print(json.dumps(result, ensure_ascii=False))
        else:
            r = result.get("reuse") or {}
            print(f"step {i}: reused {r.get('reused')} computed {r.get('computed')} invalidated "
                  f"{r.get('invalidated')} first invalidated {r.get('first_invalidated_position')}")
            print(result.get("text") or f"error: {result.get('error')}")
    return 1 if failed else 0


CHAT_HELP = "/edit N text · /regen · /stats · /reset · /quit"


def cmd_chat(ns) -> int:
    from .session import Request
    loaded, session = _open(ns)
    msgs = [{"role": "system", "content": ns.system}] if ns.system else []
    print(f"kvchat · {loaded.name} on {loaded.device} ({CHAT_HELP})")
    last = None

    def reply():
        nonlocal last
        req = Request(messages=list(msgs), sampling=_sampling(ns), max_new_tokens=ns.max_new_tokens)
        print("assistant> ", end="", flush=True)
        last = run_request(session, req, stream_to=sys.stdout)
        if "error" in last:
            print(f"error: {last['error']}")
            return
        msgs.append({"role": "assistant", "content": last["text"]})
        r = last["reuse"]
        print(f"  · reused {r['reused']}, computed {r['computed']}, invalidated {r['invalidated']}"
              + (f" from position {r['first_invalidated_position']}" if r["first_invalidated_position"] is not None
                 else ""))

    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line.strip():
            continue
        if line.startswith("/"):
            cmd, *rest = line.split(maxsplit=2)
            if cmd == "/quit":
                return 0
            if cmd == "/reset":
                session.reset()
                msgs[:] = [m for m in msgs if m["role"] == "system"]
                print("(conversation and cache cleared)")
            elif cmd == "/stats":
                print(json.dumps({"cache": session.cache_stats(), "last": last and last.get("trace")}, indent=2))
            elif cmd == "/regen":
                if msgs and msgs[-1]["role"] == "assistant":
                    msgs.pop()
                    reply()
            elif cmd == "/edit" and len(rest) == 2 and rest[0].isdigit():
                users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
                n = int(rest[0])
                if not 1 <= n <= len(users):
                    print(f"(there are {len(users)} user messages)")
                    continue
                del msgs[users[n - 1]:]
                msgs.append({"role": "user", "content": rest[1]})
                reply()
            else:
                print(CHAT_HELP)
            continue
        msgs.append({"role": "user", "content": line})
        reply()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine", description="kvchat's inference engine")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="model facts: architecture, parameters, KV bytes per position")
    _model_args(p)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("generate", help="generate one reply")
    _model_args(p)
    _sampling_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="skip the chat template")
    p.add_argument("--system", default=None)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("replay", help="run a JSON list of steps in one session (one cache)")
    _model_args(p)
    _sampling_args(p)
    p.add_argument("--script", required=True)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("chat", help="interactive terminal chat")
    _model_args(p)
    _sampling_args(p)
    p.add_argument("--system", default=None)
    p = sub.add_parser("quality", help="compare a quantized model with full precision on the same prompts")
    from .quality import add_arguments as quality_arguments
    quality_arguments(p)
    p = sub.add_parser("bench", help="prefill/decode speed against references measured in the same run")
    from .bench import add_arguments
    add_arguments(p)
    sub.add_parser("selftest", help="cached == uncached, parity and the benchmark on this machine's GPU "
                                    "(python -m engine selftest --device cuda --json)", add_help=False)
    if argv is None:
        argv = sys.argv[1:]
    import torch

    from .loader import default_threads
    torch.set_num_threads(default_threads())
    if argv and argv[0] == "selftest":
        from .selftest import main as selftest_main
        return selftest_main(argv[1:])
    ns = ap.parse_args(argv)
    handler = {"info": cmd_info, "generate": cmd_generate, "replay": cmd_replay, "chat": cmd_chat}
    try:
        if ns.cmd == "bench":
            from .bench import run
            return run(ns)
        if ns.cmd == "quality":
            from .quality import main as quality_main
            return quality_main(ns)
        return handler[ns.cmd](ns)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
