"""One row of the benchmark: an engine at a precision, loaded and measured in its own process (prefill three
times on a fresh cache, decode, load time, peak memory, the tokens it chose)."""

from __future__ import annotations

import os
from pathlib import Path

from .isolation import run_isolated
from .machine import device_sync, file_read_seconds, peak_mem, reset_peak_rss, rss_now
from .roofline import gguf_tensor_bytes
from .shapes import random_prompt

# kvchat's quantized rows -> (weight mode, group size, activations): the kernels' layouts
QUANT = {
    "int8": ("int8", 0, "float32"),
    "int4": ("int4", 32, "float32"),
    "int8/a8": ("int8", 0, "int8"),
    "int4/a8": ("int4", 32, "int8"),
}


FILE_ACTIVATIONS = {"file": "float32", "file/a8": "int8"}  # --model FILE.gguf: kvchat's rows


def load_options(precision: str) -> tuple[str, int, str, str]:
    """(weight mode, group size, activations, dtype) kvchat loads a precision's row with: kvchat's quantized rows
    (QUANT) and a file's (FILE_ACTIVATIONS) in float32, a float precision as itself."""
    mode, group, activations = QUANT.get(precision, ("none", 0, FILE_ACTIVATIONS.get(precision, "float32")))
    dtype = "float32" if precision in QUANT or precision in FILE_ACTIVATIONS else precision
    return mode, group, activations, dtype


def _timing(prompt_len: int, start: float, times: list[float]) -> dict:
    ttft = times[0] - start
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None
    return {
        "tokens": len(times),
        "prefill_tok_s": round(prompt_len / ttft, 3),
        "ttft_ms": round(ttft * 1000, 3),
        "decode_tok_s": None if decode is None else round(decode, 3),
    }


CACHED_KVCHAT = ("kvchat", "kvchat-no-kernels")  # the engines that decode on kvchat's cache (not the uncached one)


def measure_row(engine: str, precision: str, args: dict, timeout: float) -> dict:
    """One engine at one precision, measured in a child process of its own."""
    got = run_isolated(_measure, (engine, precision, args), timeout)
    return got if "engine" in got else {"engine": engine, "precision": precision, **got}


def _kvchat_decode(loaded, prompt, n_new, top_logprobs: int | None = None) -> tuple[dict, list[int]]:
    """`top_logprobs`: each token's log-probabilities with that many alternatives (None: off)."""
    from ...session import Request, Session

    session = Session(loaded, capacity=len(prompt) + n_new)
    loaded.tokenizer.stop_ids = frozenset()  # random weights: never stop early
    weighed = dict(logprobs=top_logprobs is not None, top_logprobs=top_logprobs or 0)
    for ev in session.generate(Request(prompt_ids=tuple(prompt), max_new_tokens=n_new, **weighed)):
        last = ev
    t = last.trace
    return {
        "tokens": t["tokens"],
        "prefill_tok_s": t["prefill_tok_s"],
        "ttft_ms": t["ttft_ms"],
        "decode_tok_s": t["decode_tok_s"],
    }, list(last.token_ids)


def _measure(engine: str, precision: str, a: dict) -> dict:
    import torch

    torch.set_num_threads(a["threads"])
    from ...devices import resolve_device
    from ...trace import now
    from ...weights.loading import load_model

    device = resolve_device(a["device"])
    row = {"engine": engine, "precision": precision, "device": str(device)}
    with torch.device("meta"):  # torch's one-time import of its meta kernels (~70 MB), before the baseline
        torch.nn.Embedding(2, 2)
    if engine == "kvchat-no-kernels":  # this child process only: kvchat as it runs without a C compiler
        os.environ["KVCHAT_KERNELS"] = "0"
    if engine in CACHED_KVCHAT and not is_gguf_model(a["model"]):  # what load is compared with
        row["file_read_s"] = round(file_read_seconds(a["model"]), 6)  # small files read in well under 1 ms
    reset_peak_rss()  # that read's buffer is not the model's memory
    baseline = rss_now()
    n_new = a["new_tokens"]
    contexts = a["plot_contexts"]
    if engine.startswith("kvchat"):
        mode, group, activations, dtype = load_options(precision)
        t0 = now()
        loaded = load_model(
            a["model"], device=str(device), dtype=dtype, weights=mode, group_size=group, activations=activations
        )
        row["load_s"] = round(now() - t0, 3)
        vocab = loaded.config.vocab_size
        prompt = random_prompt(a["prompt_tokens"], vocab)
        from ...backends.quantized_model import weight_bytes

        row.update(
            weight_bytes=loaded.weight_bytes,
            read_weight_bytes=loaded.active_weight_bytes,  # a mixture's decode reads k of E experts
            kv_bytes_per_position=loaded.kv_bytes_per_position(),
            weights=loaded.quantization,
            activations=loaded.activations,
            embed_bytes=weight_bytes(loaded.model.embed),
        )
        row["decode_kernels"] = loaded.decode_kernels
        if engine in CACHED_KVCHAT:
            row["kv_allocated_bytes"] = (len(prompt) + n_new) * loaded.kv_bytes_per_position()

            def decode(prompt, n):
                return _kvchat_decode(loaded, prompt, n)
        else:
            n_new = a["uncached_tokens"]
            ids = torch.tensor([prompt], device=device)
            times = []
            start = now()
            with torch.inference_mode():
                for _ in range(n_new):
                    nxt = loaded.model(ids, last_only=True)[0, -1].argmax()  # the whole prefix, every step
                    device_sync(device)
                    times.append(now())
                    ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            row.update(_timing(len(prompt), start, times))
            decode = None  # one measurement only: each token costs a whole prefill
    elif engine.startswith("transformers"):
        import transformers
        from transformers import AutoModelForCausalLM
        from transformers.generation.streamers import BaseStreamer

        transformers.utils.logging.disable_progress_bar()
        dtype = getattr(torch, precision)
        t0 = now()
        hf = AutoModelForCausalLM.from_pretrained(a["model"], dtype=dtype).to(device).eval()
        row["load_s"] = round(now() - t0, 3)
        row["weight_bytes"] = sum(p.numel() * p.element_size() for p in hf.parameters())
        cfg = hf.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        row["kv_bytes_per_position"] = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype.itemsize
        vocab = cfg.vocab_size

        class Clock(BaseStreamer):
            def __init__(self):
                self.times, self.ids = [], []

            def put(self, value):
                device_sync(device)
                self.times.append(now())
                self.ids.append(int(value.view(-1)[-1]))

            def end(self):
                pass

        def decode(prompt, n):
            clock = Clock()
            ids = torch.tensor([prompt], device=device)
            extra = {"cache_implementation": "static"} if engine == "transformers-static" else {}
            start = now()
            with torch.inference_mode():
                hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    streamer=clock,
                    pad_token_id=0,
                    **extra,
                )
            return _timing(len(prompt), start, clock.times[1:]), clock.ids[1:]  # the first put() is the prompt
    elif engine == "llama.cpp":
        from ...kv_cache import bytes_per_position
        from ..llamacpp import LlamaCpp

        cfg = model_config(a["model"])
        path = Path(a["gguf"][precision])
        t0 = now()
        moe = cfg.num_experts > 0
        lc = LlamaCpp(
            path,
            n_ctx=max([a["prompt_tokens"] + n_new, *contexts]) + a["plot_tokens"] + 8,
            threads=a["threads"],
            repack=not moe,
        )
        row["load_s"] = round(now() - t0, 3)
        if moe:
            row["note"] = "repack off (its repacked MoE product crashes here)"
        row["weight_bytes"], row["embed_bytes"], row["read_weight_bytes"] = gguf_tensor_bytes(path)
        row["kv_bytes_per_position"] = bytes_per_position(cfg, torch.float16)  # its default F16 cache
        vocab = cfg.vocab_size

        def decode(prompt, n):
            lc.L.llama_memory_clear(lc.L.llama_get_memory(lc.ctx), True)
            ids, start, times = lc.generate(prompt, n)
            return _timing(len(prompt), start, times), ids
    else:
        raise ValueError(f"unknown engine {engine!r}")
    if decode is not None:  # the same measurement for every engine: the prompt, then each --plot context
        prompt = random_prompt(a["prompt_tokens"], vocab)
        timing, row["token_ids"] = decode(prompt, n_new)
        # Prefill is one short measurement: repeat it (a fresh cache each time) and keep the median run.
        runs = [timing] + [decode(prompt, 1)[0] for _ in range(a["prefill_runs"] - 1)]
        median = sorted(runs, key=lambda t: t["ttft_ms"])[len(runs) // 2]
        timing.update(prefill_tok_s=median["prefill_tok_s"], ttft_ms=median["ttft_ms"])
        row.update(timing, peak_mem_bytes=peak_mem(device))  # before the --plot contexts
        row["by_context"] = {c: decode(random_prompt(c, vocab), a["plot_tokens"])[0]["decode_tok_s"] for c in contexts}
        if a.get("logprobs_cost") and engine in CACHED_KVCHAT:
            row["logprobs_cost"] = _logprobs_cost(loaded, prompt, n_new)
    row.setdefault("peak_mem_bytes", peak_mem(device))
    row["baseline_mem_bytes"] = baseline if device.type == "cpu" else 0
    return row


LOGPROBS_ROUNDS = 3  # off, k = 0 and k = 5 take turns this many times; the medians are kept


def _logprobs_cost(loaded, prompt, n_new) -> dict:
    """Decode tok/s with log-probabilities off, on with no alternatives and on with 5, in turns (the same
    process, the same prompt), and k = 5 against off."""
    runs = {"off": [], "k0": [], "k5": []}
    for _ in range(LOGPROBS_ROUNDS):
        for name, k in (("off", None), ("k0", 0), ("k5", 5)):
            runs[name].append(_kvchat_decode(loaded, prompt, n_new, k)[0]["decode_tok_s"])
    got = {name: sorted(v)[len(v) // 2] for name, v in runs.items()}
    got["k5_vs_off"] = round(got["k5"] / got["off"], 3) if got["off"] else None
    return got


def is_gguf_model(model) -> bool:
    from ...weights.gguf_header import is_gguf

    return model is not None and is_gguf(model)


def model_config(model):
    """A model's config: from config.json, or from a GGUF file's metadata."""
    from ...config import config_from_dict, load_config

    if is_gguf_model(model):
        from ...weights.gguf_file import GGUFModel

        return config_from_dict(GGUFModel(model).config_dict(), Path(model))
    return load_config(Path(model))
