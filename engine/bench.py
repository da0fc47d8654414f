"""`python -m engine bench`: prefill and decode speed of this engine against references in the same run.

Each engine runs in its own child process (same thread count), so the peak memory it reports
(VmHWM) is its own. Without --model, a random-weight checkpoint of a known shape is written to
a temporary folder and loaded through the normal path, so load time is measured too.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import sys
import tempfile
from pathlib import Path

SHAPES = {
    "smollm2-135m": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                     "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
                     "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True},
    "qwen2.5-0.5b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
                     "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
}


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="a real checkpoint instead of a random-weight shape")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--weights", default="none", choices=["none", "int8", "int4"], help="kvchat's weight precision")
    p.add_argument("--kv", default="none", choices=["none", "int8", "int4"], help="kvchat's KV cache precision")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--uncached-tokens", type=int, default=8,
                   help="tokens for the no-cache baseline (each one recomputes the whole prefix)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: physical cores)")
    p.add_argument("--engines", default="kvchat,kvchat-uncached,transformers",
                   help="comma-separated subset of kvchat, kvchat-uncached, transformers")
    p.add_argument("--json", action="store_true")


def write_random_checkpoint(out: Path, shape: str, seed: int = 0) -> Path:
    """A checkpoint of `shape` with random weights and a word-level tokenizer covering its vocabulary."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    from .config import config_from_dict
    from .model import Transformer
    raw = dict(SHAPES[shape], hidden_act="silu", torch_dtype="float32")
    cfg = config_from_dict(raw)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Transformer(cfg)
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    out.mkdir(parents=True, exist_ok=True)
    tensors = model.hf_state_dict()
    tensors.pop("lm_head.weight", None) if cfg.tie_word_embeddings else None
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw))
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(out / "tokenizer.json"))
    return out


def _peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_mem(device) -> int:
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _peak_rss()


def _prompt(n: int, vocab: int) -> list[int]:
    import torch
    g = torch.Generator().manual_seed(1234)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def _child(engine: str, args: dict, queue) -> None:
    try:
        queue.put(_measure(engine, args))
    except Exception as e:  # report, don't hang the parent
        queue.put({"engine": engine, "error": f"{type(e).__name__}: {e}"})


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(engine: str, a: dict) -> dict:
    import torch
    torch.set_num_threads(a["threads"])
    from .loader import load_model
    from .trace import now
    t0 = now()
    quant = dict(weights=a["weights"], group_size=a["group_size"]) if engine == "kvchat" else {}
    loaded = load_model(a["model"], device=a["device"], dtype=a["dtype"], **quant)
    load_s = now() - t0
    device = loaded.device
    prompt = _prompt(a["prompt_tokens"], loaded.config.vocab_size)
    n_new = a["new_tokens"]
    row = {"engine": engine, "dtype": str(loaded.dtype).removeprefix("torch."), "device": str(device),
           "load_s": round(load_s, 3)}
    if engine == "kvchat":
        from .session import Request, Session
        session = Session(loaded, capacity=len(prompt) + n_new, kv=a["kv"])
        row.update(weights=loaded.quantization, kv=a["kv"])
        session.loaded.tokenizer.stop_ids = frozenset()  # random weights: never stop early
        for ev in session.generate(Request(prompt_ids=tuple(prompt), max_new_tokens=n_new)):
            last = ev
        t = last.trace
        row.update(tokens=t["tokens"], prefill_tok_s=t["prefill_tok_s"], ttft_ms=t["ttft_ms"],
                   decode_tok_s=t["decode_tok_s"])
    elif engine == "kvchat-uncached":
        n_new = a["uncached_tokens"]
        ids = torch.tensor([prompt], device=device)
        times = []
        start = now()
        with torch.inference_mode():
            for _ in range(n_new):
                logits = loaded.model(ids, last_only=True)  # the whole prefix, every step
                nxt = logits[0, -1].argmax()
                _sync(device)
                times.append(now())
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        ttft = times[0] - start
        row.update(tokens=n_new, prefill_tok_s=round(len(prompt) / ttft, 3), ttft_ms=round(ttft * 1000, 3),
                   decode_tok_s=round((n_new - 1) / (times[-1] - times[0]), 3))
    elif engine.startswith("transformers"):
        del loaded
        from transformers import AutoModelForCausalLM
        from transformers.generation.streamers import BaseStreamer
        t0 = now()
        hf = AutoModelForCausalLM.from_pretrained(a["model"], dtype=getattr(torch, row["dtype"])).to(device).eval()
        row["load_s"] = round(now() - t0, 3)

        class Clock(BaseStreamer):
            def __init__(self):
                self.times = []

            def put(self, value):
                _sync(device)
                self.times.append(now())

            def end(self):
                pass

        clock = Clock()
        ids = torch.tensor([prompt], device=device)
        start = now()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                        do_sample=False, streamer=clock, pad_token_id=0)
        times = clock.times[1:]  # the first put() is the prompt
        ttft = times[0] - start
        row.update(tokens=len(times), prefill_tok_s=round(len(prompt) / ttft, 3), ttft_ms=round(ttft * 1000, 3),
                   decode_tok_s=round((len(times) - 1) / (times[-1] - times[0]), 3))
    row["peak_mem_bytes"] = _peak_mem(device)
    return row


def _ratio(a, b):
    return None if not a or not b else round(a / b, 3)


def run(ns) -> int:
    threads = ns.threads or max(1, (os.cpu_count() or 2) // 2 if _smt() else (os.cpu_count() or 1))
    engines = [e.strip() for e in ns.engines.split(",") if e.strip()]
    if "transformers" in engines and importlib.util.find_spec("transformers") is None:
        print("transformers is not installed: skipping that reference", file=sys.stderr)
        engines.remove("transformers")
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-") as tmp:
        model = ns.model or str(write_random_checkpoint(Path(tmp) / ns.shape, ns.shape))
        args = {"model": model, "device": ns.device, "dtype": ns.dtype, "prompt_tokens": ns.prompt_tokens,
                "new_tokens": ns.new_tokens, "uncached_tokens": ns.uncached_tokens, "threads": threads,
                "weights": ns.weights, "kv": ns.kv, "group_size": ns.group_size}
        ctx = mp.get_context("spawn")
        results = []
        for engine in engines:
            q = ctx.Queue()
            p = ctx.Process(target=_child, args=(engine, args, q))
            p.start()
            row = q.get()
            p.join()
            results.append(row)
            if not ns.json:
                print(f"  measured {engine}", file=sys.stderr)
    by = {r["engine"]: r for r in results}
    k = by.get("kvchat", {})
    ratios = {
        "decode_vs_uncached": _ratio(k.get("decode_tok_s"), by.get("kvchat-uncached", {}).get("decode_tok_s")),
        "decode_vs_transformers": _ratio(k.get("decode_tok_s"), by.get("transformers", {}).get("decode_tok_s")),
        "prefill_vs_transformers": _ratio(k.get("prefill_tok_s"), by.get("transformers", {}).get("prefill_tok_s")),
    }
    report = {"model": ns.model or ns.shape, "prompt_tokens": ns.prompt_tokens, "new_tokens": ns.new_tokens,
              "threads": threads, "results": results, "ratios": ratios}
    if ns.json:
        print(json.dumps(report))
        return 0
    print(f"model {report['model']} · prompt {ns.prompt_tokens} · new {ns.new_tokens} · threads {threads}")
    print(f"{'engine':18s} {'dtype':9s} {'prefill tok/s':>13s} {'TTFT ms':>9s} {'decode tok/s':>12s} "
          f"{'peak MiB':>9s} {'load s':>7s}")
    for r in results:
        if "error" in r:
            print(f"{r['engine']:18s} error: {r['error']}")
            continue
        print(f"{r['engine']:18s} {r['dtype']:9s} {r['prefill_tok_s']:13.1f} {r['ttft_ms']:9.1f} "
              f"{r['decode_tok_s']:12.2f} {r['peak_mem_bytes'] / 2**20:9.0f} {r['load_s']:7.2f}")
    for name, v in ratios.items():
        print(f"{name:26s} {'—' if v is None else f'{v:.2f}x'}")
    return 0


def _smt() -> bool:
    try:
        return int(Path("/sys/devices/system/cpu/smt/active").read_text().strip()) == 1
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    raise SystemExit(run(ap.parse_args()))
