"""`python -m engine store-bench`: what the prefix store saves when a person goes back and forth
between conversations.

Two conversations of about --positions positions each, taken in turn (A, B, A, B, ...): each return
adds the reply and a new message. The same prompts run twice in this process: through a session
with the prefix store, and through one without it (budget 0), so every return's TTFT has a cold
prefill of the same prompt beside it. Reported per step: where the reuse came from, positions
reused and computed, bytes copied and the copy's time, TTFT with and without the store and their
ratio, and the bytes the store holds.

Then a restart: a new session over the same disk tier (what a new run of the app finds in its data folder;
the files in the operating system's page cache, as after a restart without a reboot) returns to each
conversation, against a cold prefill of the same prompt: the share of a cold prefill a return costs after a
restart, and the disk bytes per position.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from .bench.machine import cpu_info
from .bench.shapes import SHAPES, write_random_checkpoint


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="a real checkpoint instead of a random-weight shape")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--device", default=None, help="cpu or cuda (default: the best available)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--weights", default="none", choices=("none", "int8", "int4"))
    p.add_argument("--kv", default="none", choices=("none", "int8", "int4"))
    p.add_argument("--positions", type=int, default=2000, help="each conversation's length at its first turn")
    p.add_argument("--rounds", type=int, default=3, help="turns per conversation (the first is cold)")
    p.add_argument("--message", type=int, default=24, help="positions of each new message")
    p.add_argument("--new-tokens", type=int, default=8, help="reply tokens per turn")
    p.add_argument("--cache-budget", type=int, default=None, help="the store's bytes (default: a share of free memory)")
    p.add_argument("--disk-budget", type=int, default=8 * 2**30, help="the disk tier's bytes for the restart round")
    p.add_argument("--json", action="store_true")


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(4, vocab) for _ in range(n)]


def _against_cold(prompt, got, ref) -> dict:
    """One return's figures beside the cold prefill of the same prompt (`ref`): reuse, TTFT, their ratio."""
    r = got.reuse
    return {
        "prompt_positions": len(prompt),
        "source": r.source,
        "reused": r.reused,
        "computed": r.computed,
        "ttft_ms": got.trace["ttft_ms"],
        "ttft_without_store_ms": ref.trace["ttft_ms"],
        "ratio": round(got.trace["ttft_ms"] / ref.trace["ttft_ms"], 4),
        "same_reply": got.token_ids == ref.token_ids,
    }


def run(ns) -> int:
    import torch

    from ..disk_store import DiskStore
    from ..session import Request, Session
    from ..weights.loading import load_model

    with tempfile.TemporaryDirectory() as tmp:
        path = ns.model or write_random_checkpoint(Path(tmp) / ns.shape, ns.shape)
        loaded = load_model(path, device=ns.device, dtype=ns.dtype, weights=ns.weights)
        vocab = loaded.config.vocab_size
        capacity = ns.positions + ns.rounds * (ns.message + ns.new_tokens) + 16
        disk_dir = Path(tmp) / "disk"
        stored = Session(
            loaded, capacity=capacity, kv=ns.kv, cache_budget=ns.cache_budget, disk=DiskStore(disk_dir, ns.disk_budget)
        )
        cold = Session(loaded, capacity=capacity, kv=ns.kv, cache_budget=0)
        for s in (stored, cold):  # warm the kernels and allocator on a short prompt
            list(s.generate(Request(prompt_ids=tuple(_ids(0, 64, vocab)), max_new_tokens=2)))
            s.reset()

        def ttft(session, prompt, label):
            events = list(
                session.generate(Request(prompt_ids=tuple(prompt), max_new_tokens=ns.new_tokens, label=label))
            )
            fin = events[-1]
            if not hasattr(fin, "token_ids"):
                raise SystemExit(f"error: {fin.error}")
            return fin

        convs = {name: _ids(seed, ns.positions, vocab) for name, seed in (("A", 1), ("B", 2))}
        steps = []
        for rnd in range(ns.rounds):
            for name, prompt in convs.items():
                stored.flush()  # the disk's writer idle: it does not share the CPU with the request measured
                got = ttft(stored, prompt, name)
                ref = ttft(cold, prompt, name)
                r = got.reuse
                steps.append(
                    {"conversation": name, "turn": rnd + 1, **_against_cold(prompt, got, ref)}
                    | {"copied_bytes": r.copied_bytes, "copy_ms": r.copy_ms, "stashed_bytes": r.stashed_bytes}
                    | {"stash_ms": r.stash_ms, "store_bytes": stored.store.bytes}
                )
                prompt += list(got.token_ids) + _ids(100 * rnd + ord(name), ns.message, vocab)
        stored.flush()
        restart = []
        for name, prompt in convs.items():  # a new session over the same disk tier: the app started again
            again = Session(loaded, capacity=capacity, kv=ns.kv, cache_budget=ns.cache_budget,
                            disk=DiskStore(disk_dir, ns.disk_budget))  # fmt: skip
            list(again.generate(Request(prompt_ids=tuple(_ids(0, 64, vocab)), max_new_tokens=2)))  # warm, as above
            got, ref = ttft(again, prompt, name), ttft(cold, prompt, name)
            restart.append(
                {"conversation": name, **_against_cold(prompt, got, ref)}
                | {"read_bytes": got.reuse.copied_bytes, "read_ms": got.reuse.copy_ms}
            )
        disk = stored.disk.stats(stored.disk_fingerprint)
        returns = [s["ratio"] for s in steps if s["turn"] > 1]
        report = {
            "model": str(ns.model or ns.shape),
            "device": str(loaded.device),
            "dtype": str(loaded.dtype).replace("torch.", ""),
            "weights": ns.weights,
            "kv": ns.kv,
            "cpu": cpu_info() if loaded.device.type == "cpu" else None,
            "threads": torch.get_num_threads(),
            "kv_bytes_per_position": stored.cache.bytes_per_position,
            "budget": stored.store.budget,
            "steps": steps,
            "worst_return_ratio": max(returns) if returns else None,
            "store": stored.store.stats(),
            "restart": restart,
            "worst_restart_ratio": max(s["ratio"] for s in restart),
            "disk": disk,
            "disk_bytes_per_position": round(disk["bytes_this_model"] / max(1, disk["blocks_this_model"] * 16), 1),
        }
    if ns.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['model']} on {report['device']} ({report['dtype']}, weights {ns.weights}, KV {ns.kv})")
    if report["cpu"]:
        print(f"CPU: {report['cpu'].get('model')} · {report['threads']} threads")
    head = "step  conv  prompt  source   reused  computed  stash ms  copied MiB  copy ms  TTFT ms  cold ms  ratio  same"
    print(head)
    for i, s in enumerate(steps):
        cells = [
            f"{i + 1:4d}  {s['conversation']:>4}  {s['prompt_positions']:6d}  {s['source']:7s}  {s['reused']:6d}",
            f"{s['computed']:8d}  {s['stash_ms'] or 0:8.1f}  {s['copied_bytes'] / 2**20:10.1f}",
            f"{s['copy_ms'] or 0:7.1f}  {s['ttft_ms']:7.1f}  {s['ttft_without_store_ms']:7.1f}",
            f"{s['ratio']:5.3f}  {s['same_reply']}",
        ]
        print("  ".join(cells))
    st = report["store"]
    print(
        f"store: {st['bytes'] / 2**20:,.1f} MiB of {st['budget'] / 2**20:,.0f} MiB, {st['prefixes']} prefixes, "
        f"{st['evictions']} evictions · worst return / cold TTFT: {report['worst_return_ratio']}"
    )
    print("after a restart (a new session over the same disk tier):")
    print("conv  prompt  source  reused  computed  read MiB  read ms  TTFT ms  cold ms  ratio  same")
    for s in restart:
        print(
            f"{s['conversation']:>4}  {s['prompt_positions']:6d}  {s['source']:6s}  {s['reused']:6d}  "
            f"{s['computed']:8d}  {s['read_bytes'] / 2**20:8.1f}  {s['read_ms'] or 0:7.1f}  {s['ttft_ms']:7.1f}  "
            f"{s['ttft_without_store_ms']:7.1f}  {s['ratio']:5.3f}  {s['same_reply']}"
        )
    d = report["disk"]
    print(
        f"disk: {d['bytes'] / 2**20:,.1f} MiB in {d['blocks']} blocks, {report['disk_bytes_per_position']:,.0f} B per "
        f"position · worst restart return / cold TTFT: {report['worst_restart_ratio']}"
    )
    return 0
