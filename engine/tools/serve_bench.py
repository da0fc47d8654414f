"""`python -m engine serve-bench`: what serving costs — the same model streamed through
`python -m engine serve` on loopback (a separate process, read by the remote session the app uses)
against the engine in this process, in the same run, rounds alternating.

Each round's prompt is new on both sides (the same sequence of prompts, so reuse is equal); replies
run to --new-tokens past any stop token. Reported: TTFT and decode tokens/s on each side (the
served ones at chunk arrival, the network and the server's JSON included), the decode ratio, TTFT's
overhead as the median of each round's difference, the part of it HTTP adds (client-side minus the
server's own TTFT), and the server's own figures.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .bench.machine import served_facts
from .bench.shapes import SHAPES, write_random_checkpoint


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="a model folder or GGUF file instead of a random-weight shape")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--weights", default="none", choices=("none", "int8", "int4"))
    p.add_argument(
        "--activations",
        default="float32",
        choices=("float32", "int8"),
        help="what quantized weights' decode products multiply by (int8: the named approximation, VNNI's products)",
    )
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5, help="requests per side (after one warm-up each)")
    p.add_argument(
        "--concurrency",
        default=None,
        metavar="1,2,4,8",
        help="many requests at once through the engine's scheduler instead (engine.tools.concurrency_bench)",
    )
    p.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="with --concurrency: each request's KV capacity (default: what the prompts and replies need)",
    )
    p.add_argument("--json", action="store_true")


def _prompt(rnd: random.Random, n: int, word_level: bool, tokenizer) -> str:
    """About n tokens of text: random vocabulary words (a random-weight shape) or real text repeated."""
    if word_level:
        return " ".join(f"t{rnd.randrange(4, 40000)}" for _ in range(n))
    base = "The quick brown fox jumps over the lazy dog near the river bank at dawn. "
    text = f"Note {rnd.randrange(10**9)}: " + base * (n // 14 + 1)
    ids = tokenizer.encode_text(text)[:n]
    return tokenizer.decode(ids)


def free_port() -> int:
    """A TCP port free on loopback now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], ready_url: str, timeout: float = 300.0, **popen) -> subprocess.Popen:
    """Start a server process and wait until GET `ready_url` answers 200; RuntimeError if it exits first or
    stays silent for `timeout` seconds (then it is killed)."""
    import httpx

    proc = subprocess.Popen(cmd, **popen)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the server did not come up in {timeout:.0f} s")


def run(ns) -> int:
    if ns.concurrency:
        from .concurrency_bench import run_concurrency

        return run_concurrency(ns)

    from ..http.remote import RemoteSession, RemoteSpec
    from ..session import Request, Session
    from ..trace import now
    from ..weights.loading import load_model

    with tempfile.TemporaryDirectory() as tmp:
        path = str(ns.model or write_random_checkpoint(Path(tmp) / ns.shape, ns.shape))
        loaded = load_model(path, weights=ns.weights, activations=ns.activations)
        local = Session(loaded)
        port = free_port()
        cmd = [sys.executable, "-m", "engine", "serve", "--model", path, "--weights", ns.weights, "--port", str(port)]
        cmd += ["--activations", ns.activations]
        log = Path(tmp) / "serve.log"
        try:
            with open(log, "wb") as out:
                proc = start_server(cmd, f"http://127.0.0.1:{port}/health", stdout=out, stderr=subprocess.STDOUT)
        except RuntimeError as e:
            raise SystemExit(f"error: {e}: {log.read_text(errors='replace')[-2000:]}") from None
        remote = RemoteSession(RemoteSpec(f"http://127.0.0.1:{port}/v1"))
        try:
            remote.connect()
            rnd = random.Random(0)
            word_level = ns.model is None

            def request(text: str) -> Request:
                msgs = [{"role": "user", "content": text}]
                return Request(messages=msgs, max_new_tokens=ns.new_tokens, ignore_eos=True, arrival=now())

            def once(session, text: str) -> dict:
                fin = list(session.generate(request(text)))[-1]
                if not hasattr(fin, "token_ids"):
                    raise SystemExit(f"error: {fin.error}")
                return fin.trace

            warm = _prompt(rnd, ns.prompt_tokens, word_level, loaded.tokenizer)
            once(local, warm), once(remote, warm)
            rows = []
            for i in range(ns.rounds):
                text = _prompt(rnd, ns.prompt_tokens, word_level, loaded.tokenizer)
                a, b = (local, remote) if i % 2 == 0 else (remote, local)  # alternate who goes first
                first, second = once(a, text), once(b, text)
                mine, served = (first, second) if a is local else (second, first)
                rows.append(
                    {
                        "round": i + 1,
                        "prompt_tokens": mine["prompt_tokens"],
                        "in_process_ttft_ms": mine["ttft_ms"],
                        "served_ttft_ms": served["ttft_ms"],
                        "server_side_ttft_ms": served["server"]["ttft_ms"],
                        "in_process_tok_s": mine["decode_tok_s"],
                        "served_tok_s": served["decode_tok_s"],
                        "server_side_tok_s": served["server"]["decode_tok_s"],
                        "served_tokens": served["server"]["tokens"],
                    }
                )
        finally:
            remote.close()
            proc.terminate()
            proc.wait(10)

    def med(key):
        return statistics.median(r[key] for r in rows)

    report = {
        **served_facts(ns, loaded),
        "rounds": rows,
        "in_process_tok_s": med("in_process_tok_s"),
        "served_tok_s": med("served_tok_s"),
        "decode_ratio": round(med("served_tok_s") / med("in_process_tok_s"), 4),
        "in_process_ttft_ms": med("in_process_ttft_ms"),
        "served_ttft_ms": med("served_ttft_ms"),
        # per round, paired: served − in-process (what serving costs), and served − the server's own (the HTTP part)
        "ttft_overhead_ms": round(statistics.median(r["served_ttft_ms"] - r["in_process_ttft_ms"] for r in rows), 3),
        "http_ttft_ms": round(statistics.median(r["served_ttft_ms"] - r["server_side_ttft_ms"] for r in rows), 3),
    }
    if ns.json:
        print(json.dumps(report, indent=2))
        return 0
    cpu = report["cpu"] or {}
    print(f"{report['model']} (weights {ns.weights}) on {report['device']} · {cpu.get('model', '')} · "
          f"{report['threads']} threads · {ns.prompt_tokens} prompt tokens, {ns.new_tokens} new")  # fmt: skip
    print("round  TTFT in-process  served (server-side)   tok/s in-process  served (server-side)")
    for r in rows:
        ttft = f"{r['in_process_ttft_ms']:15.1f}  {r['served_ttft_ms']:6.1f} ({r['server_side_ttft_ms']:6.1f})"
        rate = f"{r['in_process_tok_s']:16.1f}  {r['served_tok_s']:6.1f} ({r['server_side_tok_s']:6.1f})"
        print(f"{r['round']:5d}  {ttft}   {rate}")
    print(
        f"median decode: served {report['served_tok_s']:.1f} tok/s = {report['decode_ratio']:.3f} of in-process "
        f"{report['in_process_tok_s']:.1f}; TTFT overhead (paired median) {report['ttft_overhead_ms']:+.1f} ms, "
        f"of which HTTP (client − server-side) {report['http_ttft_ms']:+.1f} ms"
    )
    return 0
