"""`python -m engine info|generate|replay|chat|models|serve|search|pull`: the engine's command line (its tools
add bench, quality and selftest: see engine/__main__.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .backends.kernel_build import variants as kernel_variants
from .devices import default_threads
from .errors import EngineError
from .events import Failed, Finished, PrefillStarted, Token
from .grammar import grammar_line
from .images import ImageError, image_file
from .logprobs import reply_confidence
from .request_options import at_least_one, draft_args, overflow_arg, request_fields, sampling, sampling_args
from .session import Request
from .spec import LoadSpec
from .speculative import draft_line

TRACE_FIELDS = (
    "ttft_ms",
    "tpot_ms",
    "tokens",
    "decode_tok_s",
    "prefill_ms",
    "prefill_tok_s",
    "e2e_ms",
    "mean_ms_per_token_incl_wait",
    "ttft_queue_ms",
    "ttft_tokenize_ms",
    "ttft_prefill_ms",
    "ttft_first_token_ms",
    "draft_load_ms",
    "speculative",
    "grammar",
    "images",
)


class LoadProgress:
    """`loading NAME: 45%` on stderr while the weights are read: redrawn in place on a terminal, a line
    per quarter otherwise (logs, pipes)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.shown = -1

    def __call__(self, fraction: float, what: str) -> None:
        pct = int(round(fraction * 100))
        step = pct if self.tty else pct // 25 * 25
        if step == self.shown:
            return
        self.shown = step
        end = "\n" if not self.tty or pct >= 100 else ""
        self.stream.write(("\r" if self.tty else "") + f"loading {what}: {step}%" + end)
        self.stream.flush()


OPENED: list = []  # the sessions a command opened: their disk tier is written out before the process ends


def _open(ns):
    loaded, session = LoadSpec.from_args(ns).open(LoadProgress())
    OPENED.append(session)
    return loaded, session


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
            result.update(
                text=ev.text,
                token_ids=list(ev.token_ids),
                stop_reason=ev.reason,
                trace={k: ev.trace[k] for k in TRACE_FIELDS}
                | ({"ttft_vision_ms": ev.trace["ttft_vision_ms"]} if "ttft_vision_ms" in ev.trace else {}),
                reuse=ev.reuse.to_dict(),
                cache=ev.cache,
            )
            if req.logprobs:
                result["logprobs"] = [s.to_dict() for s in ev.logprobs]
                result["confidence"] = reply_confidence(result["logprobs"])
        elif isinstance(ev, Failed):
            result.update(error=ev.error, error_kind=ev.kind, stop_reason=None, trace=ev.trace, cache=ev.cache)
    return result


def _dropped_words(r: dict) -> str:
    """What an overflow policy left out, for a line of the command line's output ("" when nothing)."""
    if not r.get("dropped_positions"):
        return ""
    which = r.get("dropped_messages") or ()
    what = f"messages {', '.join(str(i + 1) for i in which)}" if which else "tokens"
    return f" · left out to fit the cache ({r.get('overflow')}): {what}, {r['dropped_positions']} positions"


def _messages(system, user_text, images=()):
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": user_text} | ({"images": tuple(images)} if images else {})]


def _images(paths) -> tuple | None:
    """--image FILE... read and checked before the model is opened (None: one is refused, its reason on stderr)."""
    try:
        return tuple(image_file(p) for p in paths or ())
    except ImageError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def cmd_info(ns) -> int:
    loaded, session = _open(ns)
    facts = session.facts()
    del facts["cache"], facts["cache_dropped"]
    facts["chat_template"] = loaded.tokenizer.has_chat_template
    facts["stop_token_ids"] = sorted(loaded.tokenizer.stop_ids)
    facts["kernel_variants"] = kernel_variants()  # what KVCHAT_KERNELS_VARIANT may force on this CPU
    if ns.json:
        print(json.dumps(facts, indent=2))
    else:
        for k, v in facts.items():
            print(f"{k:26s} {v}")
    return 0


def cmd_generate(ns) -> int:
    images = _images(ns.image)
    if images is None:
        return 2
    if images and ns.raw:
        print("error: --image needs the chat template (not --raw): it places the images", file=sys.stderr)
        return 2
    loaded, session = _open(ns)
    weighed = dict(logprobs=ns.logprobs is not None, top_logprobs=ns.logprobs or 0, overflow=ns.overflow,
                   **request_fields(ns))  # fmt: skip
    if ns.raw:
        req = Request(prompt=ns.prompt, sampling=sampling(ns), max_new_tokens=ns.max_new_tokens, **weighed)
    else:
        messages = _messages(ns.system, ns.prompt, images)
        req = Request(messages=messages, sampling=sampling(ns), max_new_tokens=ns.max_new_tokens, **weighed)
    result = run_request(session, req, stream_to=None if ns.json else sys.stdout)
    if ns.json:
        print(json.dumps(result, ensure_ascii=False))
    elif "error" not in result:
        t = result["trace"]
        tpot = "—" if t["tpot_ms"] is None else f"{t['tpot_ms']:.1f} ms"
        print(
            f"[{result['stop_reason']}] {t['tokens']} tokens · TTFT {t['ttft_ms']:.1f} ms · TPOT {tpot} · "
            f"cache {result['cache']['positions']}/{result['cache']['capacity']}",
            file=sys.stderr,
        )
        if t.get("speculative"):
            print(draft_line(t["speculative"]), file=sys.stderr)
        if t.get("grammar"):
            print(grammar_line(t["grammar"]), file=sys.stderr)
        if t.get("images"):
            print(image_line(t["images"]), file=sys.stderr)
        if "confidence" in result:
            c = result["confidence"]
            mean = "—" if c["mean_logprob"] is None else f"{c['mean_logprob']:.3f}"
            ppl = "—" if c["perplexity"] is None else f"{c['perplexity']:.2f}"
            low = c["low_confidence"]
            line = f"mean log-probability {mean} · perplexity {ppl} · low-confidence tokens (p < 0.5): {low}"
            print(line, file=sys.stderr)
    if "error" in result:
        print(f"error: {result['error']}", file=sys.stderr)
        return 1
    return 0


def cmd_replay(ns) -> int:
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
        overrides = {
            k: step[k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed") if k in step
        }
        common = dict(
            sampling=sampling(ns, overrides),
            max_new_tokens=step.get("max_new_tokens", ns.max_new_tokens),
            overflow=step.get("overflow", ns.overflow),
            **request_fields(ns),
        )
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
            print(
                f"step {i}: reused {r.get('reused')} ({r.get('source')}) computed {r.get('computed')} invalidated "
                f"{r.get('invalidated')} first invalidated {r.get('first_invalidated_position')}" + _dropped_words(r)
            )
            print(result.get("text") or f"error: {result.get('error')}")
    return 1 if failed else 0


def cmd_models(ns) -> int:
    """The bundled demo model first (what `generate` runs without --model, as the app's Models dialog lists
    it), then what is on this machine."""
    from .weights.catalog import bundled_row, default_cache, scan

    found = list(scan(ns.folder, cache=None if ns.no_cache else default_cache()))
    rows = [r.to_dict() for r in [bundled_row(), *found]]
    if ns.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        n = r["parameters"]
        params = "—" if n is None else f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.0f}M" if n >= 1e6 else f"{n:,}"
        state = "ok" if r["openable"] else f"cannot open: {r['reason']}"
        print(
            f"{r['name']}  [{r['source']}, {r['format']}, {r['architecture'] or '?'}, {params} params, "
            f"{r['quantization'] or '?'}, {r['size_bytes'] / 2**20:,.1f} MiB]  {state}\n    {r['path']}"
        )
    if not found:
        print("no other models found (looked in the Hugging Face cache, LM Studio, Ollama; add folders with --folder)")
    return 0


def cmd_search(ns) -> int:
    """Text-generation models on the Hugging Face Hub whose name matches."""
    from .hub import search

    rows = search(ns.query, ns.limit)
    if ns.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
        return 0
    if not rows:
        print(f"no text-generation models match {ns.query!r}")
    for r in rows:
        gated = " · gated" if r.gated else ""
        print(f"{r.repo}  [{', '.join(r.formats) or '?'}{gated}]  {r.downloads:,} downloads · {r.likes:,} likes")
    return 0


def cmd_pull(ns) -> int:
    """REPO[:FILE] from the Hub into its cache, resumed where an earlier try stopped; prints what --model takes."""
    import time

    from .hub import pull

    started, last = time.monotonic(), [0.0]

    def report(done: int, total: int, what: str) -> None:
        now = time.monotonic()
        if now - last[0] < 0.5 and done < total:
            return
        last[0] = now
        rate = done / max(1e-6, now - started)
        left = (total - done) / rate if rate > 0 else float("inf")
        eta = f"{left:,.0f} s left" if left != float("inf") else "—"
        print(f"{what}: {done / 2**20:,.1f} / {total / 2**20:,.1f} MiB · {rate / 2**20:,.1f} MiB/s · {eta}",
              file=sys.stderr, flush=True)  # fmt: skip

    path = pull(ns.spec, report)
    print(json.dumps({"path": str(path)}) if ns.json else path)
    return 0


CHAT_HELP = "/image FILE · /edit N text · /regen · /stats · /reset · /quit"


def image_line(images: dict) -> str:
    """A request's images in a line: how many, their positions, what the encoder did."""
    done = (
        f"encoder {images['encoder_ms']:.0f} ms, {images['encoded']} encoded" if images["encoded"] else "none encoded"
    )
    return f"images {images['images']} · {done} · {images['positions']} positions"


def cmd_chat(ns) -> int:
    attached = _images(ns.image)  # the next message's images: --image for the first, /image FILE after
    if attached is None:
        return 2
    loaded, session = _open(ns)
    msgs = [{"role": "system", "content": ns.system}] if ns.system else []
    print(f"kvchat · {loaded.name} on {loaded.device} ({CHAT_HELP})")
    last = None

    def reply():
        nonlocal last
        req = Request(messages=list(msgs), sampling=sampling(ns), max_new_tokens=ns.max_new_tokens,
                      overflow=ns.overflow, **request_fields(ns))  # fmt: skip
        print("assistant> ", end="", flush=True)
        last = run_request(session, req, stream_to=sys.stdout)
        if "error" in last:
            print(f"error: {last['error']}")
            return
        msgs.append({"role": "assistant", "content": last["text"]})
        r = last["reuse"]
        print(
            f"  · reused {r['reused']} ({r['source']}), computed {r['computed']}, invalidated {r['invalidated']}"
            + (
                f" from position {r['first_invalidated_position']}"
                if r["first_invalidated_position"] is not None
                else ""
            )
            + _dropped_words(r)
        )

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
            elif cmd == "/image" and rest:
                more = _images([line.split(maxsplit=1)[1]])
                if more:
                    attached += more
                    print(f"({more[0].describe()} goes with your next message)")
            elif cmd == "/edit" and len(rest) == 2 and rest[0].isdigit():
                users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
                n = int(rest[0])
                if not 1 <= n <= len(users):
                    print(f"(there are {len(users)} user messages)")
                    continue
                kept = msgs[users[n - 1]].get("images")  # an edit of the text keeps the message's images
                del msgs[users[n - 1] :]
                msgs.append({"role": "user", "content": rest[1]} | ({"images": kept} if kept else {}))
                reply()
            else:
                print(CHAT_HELP)
            continue
        msgs.append({"role": "user", "content": line} | ({"images": attached} if attached else {}))
        attached = ()
        reply()


def image_arg(p) -> None:
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image for the model to see, before the prompt's text (repeatable; a model that sees "
                   "images: Gemma 3 4B and up, SmolVLM, Qwen2.5-VL)")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m engine",
        description="kvchat's inference engine",
        epilog="the Hub: search, pull; tools: python -m engine bench|store-bench|serve-bench|quality|selftest --help",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="model facts: architecture, parameters, KV bytes per position")
    LoadSpec.add_arguments(p)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("generate", help="generate one reply")
    LoadSpec.add_arguments(p)
    sampling_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="skip the chat template")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="each token's log-probabilities (raw and sampled), entropy and K alternatives (0-20), in the JSON "
        "and as a mean and perplexity after the reply",
    )
    p.add_argument("--system", default=None)
    p.add_argument("--json", action="store_true")
    image_arg(p)
    overflow_arg(p)
    p = sub.add_parser("replay", help="run a JSON list of steps in one session (one cache)")
    LoadSpec.add_arguments(p)
    sampling_args(p)
    p.add_argument("--script", required=True)
    p.add_argument("--json", action="store_true")
    overflow_arg(p, ' (a step\'s own "overflow" wins)')
    p = sub.add_parser("models", help="the models on this machine: Hugging Face cache, LM Studio, Ollama, folders")
    p.add_argument("--folder", action="append", default=[], help="also look in this folder (repeatable)")
    p.add_argument("--no-cache", action="store_true", help="read every file's header again")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("serve", help="serve the model over the OpenAI HTTP API (needs the serve extra)")
    LoadSpec.add_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on every request")
    p.add_argument("--served-model-name", default=None, help="the model's id in the API (default: its name)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="a reply's limit when a request sets none")
    p.add_argument("--parallel", type=at_least_one, default=4, help="requests that run at once (default 4)")
    p.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch http(s) image URLs in requests (bounded in size and time); data: URLs are always taken",
    )
    p.add_argument("--kv-pool", type=at_least_one, default=None, metavar="POSITIONS",
                   help="the KV pool's size in positions, shared by every request (default: parallel × capacity); "
                        "a request waits while its blocks would not fit beside the running ones'")  # fmt: skip
    p.add_argument("--queue-size", type=int, default=8, help="requests that may wait behind them before 429")
    draft_args(p)
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    overflow_arg(p, ' (for a request that names none; a request\'s own "overflow" field wins)')
    p = sub.add_parser("search", help="text-generation models on the Hugging Face Hub (HF_ENDPOINT)")
    p.add_argument("query")
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("pull", help="download REPO or REPO:FILE from the Hub into its cache (resumable, checked)")
    p.add_argument("spec", metavar="REPO[:FILE]")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("chat", help="interactive terminal chat")
    LoadSpec.add_arguments(p)
    sampling_args(p)
    p.add_argument("--system", default=None)
    image_arg(p)
    overflow_arg(p)
    return ap


def cmd_serve(ns) -> int:
    try:
        from .http.server import serve
    except ImportError as e:
        print(f"error: serving needs the serve extra (pip install 'kvchat[serve]'): {e}", file=sys.stderr)
        return 2
    return serve(ns, lambda: _open(ns))


COMMANDS = {
    "info": cmd_info,
    "generate": cmd_generate,
    "replay": cmd_replay,
    "chat": cmd_chat,
    "models": cmd_models,
    "serve": cmd_serve,
    "search": cmd_search,
    "pull": cmd_pull,
}


def main(argv=None) -> int:
    ns = parser().parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    torch.set_num_threads(default_threads())
    try:
        return COMMANDS[ns.cmd](ns)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        for session in OPENED:
            if not session.flush():
                print("warning: the disk cache was not fully written", file=sys.stderr)
