"""`python -m engine bench`: prefill and decode speed of this engine against references in the same run.

Each engine runs in its own child process (same thread count), so the peak memory it reports
(VmHWM) is its own, and a reference that crashes or hangs becomes a row with its error: the run
goes on. Without --model, a random-weight checkpoint of a known shape is written to a temporary
folder and loaded through the normal path, so load time is measured too. The report names the CPU
and the instruction sets the kernels use.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import platform
import queue as queues
import signal
import sys
import tempfile
import time
from pathlib import Path

ROW_TIMEOUT_S = 1800  # a row that has not reported by then is stopped and reported as timed out
CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "neon",
)

SHAPES = {
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },  # for tests
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    # a size people run: fixed costs (tokenizer, code, prefill buffers) are a small share of its memory
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
}


ENGINES = ("kvchat", "kvchat-uncached", "transformers", "transformers-static", "llama.cpp")
# (engine, precision) per device: kvchat and transformers by torch dtype (kvchat's quantized rows by
# weight mode; "/a8": with int8 activations), llama.cpp by GGUF type (F16 is its 16-bit, Q8_0/Q4_0 its 8/4-bit).
CPU_RUNS = [
    ("kvchat", "float32"),
    ("kvchat", "bfloat16"),
    ("kvchat", "float16"),
    ("kvchat", "int8"),
    ("kvchat", "int4"),
    ("kvchat", "int8/a8"),
    ("kvchat", "int4/a8"),
    ("kvchat-uncached", "float32"),
    ("transformers", "float32"),
    ("transformers", "bfloat16"),
    ("transformers-static", "float32"),
    ("transformers-static", "bfloat16"),
    ("llama.cpp", "F32"),
    ("llama.cpp", "F16"),
    ("llama.cpp", "Q8_0"),
    ("llama.cpp", "Q4_0"),
]
CUDA_RUNS = [
    ("kvchat", "bfloat16"),
    ("kvchat", "float16"),
    ("kvchat-uncached", "bfloat16"),
    ("transformers", "bfloat16"),
    ("transformers-static", "bfloat16"),
]
# kvchat's quantized rows -> (weight mode, group size, activations): the kernels' layouts
QUANT = {
    "int8": ("int8", 0, "float32"),
    "int4": ("int4", 32, "float32"),
    "int8/a8": ("int8", 0, "int8"),
    "int4/a8": ("int4", 32, "int8"),
}
FILE_ACTIVATIONS = {"file": "float32", "file/a8": "int8"}  # --model FILE.gguf: kvchat's rows
# Which rows are compared: kvchat precision -> (reference engine, its precision)
PAIRS = [
    ("float32", "transformers", "float32"),
    ("bfloat16", "transformers", "bfloat16"),
    ("float32", "transformers-static", "float32"),
    ("bfloat16", "transformers-static", "bfloat16"),
    ("float32", "llama.cpp", "F32"),
    ("float16", "llama.cpp", "F16"),
    ("bfloat16", "llama.cpp", "F16"),
    ("int8", "llama.cpp", "Q8_0"),
    ("int4", "llama.cpp", "Q4_0"),
    ("int8/a8", "llama.cpp", "Q8_0"),
    ("int4/a8", "llama.cpp", "Q4_0"),
    ("float32", "kvchat-uncached", "float32"),
    ("bfloat16", "kvchat-uncached", "bfloat16"),
    ("file", "llama.cpp", "file"),  # --model FILE.gguf: both engines on that very file
    ("file/a8", "llama.cpp", "file"),
]
FILE_RUNS = [("kvchat", "file"), ("kvchat", "file/a8"), ("llama.cpp", "file")]  # --model FILE.gguf
PLOT_CONTEXTS = (512, 1024, 2048, 4096)
# the embedding's storage per value in each row's precision (kvchat's rows report their own: embed_bytes)
EMBED_BYTES_PER_VALUE = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "F32": 4,
    "F16": 2,
    "Q8_0": 34 / 32,
    "Q4_0": 18 / 32,
}


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="a real checkpoint instead of a random-weight shape")
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--device", default=None, help="cpu or cuda (default: the best available)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {', '.join(ENGINES)}")
    p.add_argument(
        "--precisions",
        default=None,
        help="comma-separated subset of precisions to run (float32, bfloat16, float16, int8, int4, F32, "
        "F16, Q8_0, Q4_0); default: all for the device",
    )
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument(
        "--uncached-tokens",
        type=int,
        default=8,
        help="tokens for the no-cache baseline (each one recomputes the whole prefix)",
    )
    p.add_argument(
        "--prefill-runs",
        type=int,
        default=3,
        help="prefill is measured this many times (fresh cache each) and the median kept",
    )
    p.add_argument("--threads", type=int, default=None, help="threads for every engine (default: physical cores)")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="also measure decode tok/s at contexts 512..4096 and draw it (needs matplotlib)",
    )
    p.add_argument("--plot-tokens", type=int, default=16, help="tokens decoded at each context for --plot")
    p.add_argument(
        "--row-timeout",
        type=float,
        default=ROW_TIMEOUT_S,
        help="seconds a row may take before it is stopped and reported as timed out",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown (for README.md)")


def write_random_checkpoint(out: Path, shape, seed: int = 0, std: float = 0.02) -> Path:
    """A checkpoint of `shape` (a name in SHAPES, or a config dict) with random weights and a
    word-level tokenizer covering its vocabulary."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ..config import config_from_dict
    from ..model import Transformer

    raw = dict(SHAPES[shape] if isinstance(shape, str) else shape, hidden_act="silu", torch_dtype="float32")
    cfg = config_from_dict(raw)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Transformer(cfg)
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=std)
    out.mkdir(parents=True, exist_ok=True)
    tensors = model.hf_state_dict()
    tensors.pop("lm_head.weight", None) if cfg.tie_word_embeddings else None
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw))
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # "t5 t9" -> ids 5, 9
    tok.save(str(out / "tokenizer.json"))
    # a chat template, so the app can drive it too (python -m desktop.tools.seam_bench)
    template = "{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}{% if add_generation_prompt %}t3{% endif %}"
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return out


def _status_bytes(key: str) -> int | None:
    """A size line of /proc/self/status (VmRSS, VmHWM) in bytes; None where there is no such file."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss_now() -> int:
    return _status_bytes("VmRSS") or 0


def _reset_peak_rss() -> None:
    """Start VmHWM again from the current resident size (Linux: clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss() -> int:
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
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


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device=None, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second a large copy moves (read + write), best of `repeats`: the memory roofline."""
    import torch

    from ..trace import now

    device = torch.device(device or "cpu")
    n = megabytes * 2**20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = now()
        dst.copy_(src)
        _sync(device)
        best = min(best, now() - t0)
    return 2 * n / best


def file_read_seconds(model_dir) -> float:
    """Time to read the weight files into fresh memory, once: what a load is compared with."""
    from ..trace import now

    t0 = now()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        buf = bytearray(path.stat().st_size)
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)
        del buf
    return now() - t0


def bytes_per_token(
    weight_bytes: int, embed_bytes: int, tied: bool, kv_bytes_per_position: int, context: float
) -> float:
    """Bytes one batch-1 decode step must read: every weight once (an untied embedding only gives one
    row, so it is not counted), plus the cached K/V of `context` positions."""
    return weight_bytes - (0 if tied else embed_bytes) + kv_bytes_per_position * context


def roofline_tok_s(bandwidth: float, per_token: float) -> float:
    return bandwidth / per_token


def _timing(prompt_len: int, start: float, times: list[float]) -> dict:
    ttft = times[0] - start
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else None
    return {
        "tokens": len(times),
        "prefill_tok_s": round(prompt_len / ttft, 3),
        "ttft_ms": round(ttft * 1000, 3),
        "decode_tok_s": None if decode is None else round(decode, 3),
    }


def _isolated(target, args: tuple, queue) -> None:
    try:
        queue.put(("ok", target(*args)))
    except BaseException as e:  # report, don't leave the parent waiting
        queue.put(("error", f"{type(e).__name__}: {e}"))


def run_isolated(target, args: tuple = (), timeout: float = ROW_TIMEOUT_S):
    """target(*args) in a fresh child process: its value, or {"error": ...} when it raised, died (a
    crash in native code: the exit code or signal is named) or ran past `timeout` seconds (stopped)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_isolated, args=(target, args, q), daemon=True)
    p.start()
    end = time.monotonic() + timeout
    outcome = None
    try:
        while outcome is None:
            try:
                outcome = q.get(timeout=0.5)
            except queues.Empty:
                if not p.is_alive():  # it may have reported just before it ended
                    try:
                        outcome = q.get(timeout=1.0)
                    except queues.Empty:
                        outcome = ("error", f"the child process died ({_exit_reason(p.exitcode)})")
                elif time.monotonic() > end:
                    outcome = ("error", f"timed out after {timeout:g} s: stopped")
    finally:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
    kind, value = outcome
    return value if kind == "ok" else {"error": value}


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def cpu_info() -> dict:
    """The CPU the run measured: its model name, the instruction sets that matter to the kernels, and
    what kvchat's kernels were built for."""
    from ..backends import kernels

    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                name = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags |= set(value.split())
    except OSError:
        pass
    return {"model": name, "instruction_sets": [f for f in CPU_FLAGS if f in flags], "kernels": kernels.status()}


def _measure_row(engine: str, precision: str, args: dict, timeout: float) -> dict:
    """One engine at one precision, measured in a child process of its own."""
    got = run_isolated(_measure, (engine, precision, args), timeout)
    return got if "engine" in got else {"engine": engine, "precision": precision, **got}


def _kvchat_decode(loaded, prompt, n_new) -> tuple[dict, list[int]]:
    from ..session import Request, Session

    session = Session(loaded, capacity=len(prompt) + n_new)
    loaded.tokenizer.stop_ids = frozenset()  # random weights: never stop early
    for ev in session.generate(Request(prompt_ids=tuple(prompt), max_new_tokens=n_new)):
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
    from ..devices import resolve_device
    from ..trace import now
    from ..weights.loading import load_model

    device = resolve_device(a["device"])
    row = {"engine": engine, "precision": precision, "device": str(device)}
    with torch.device("meta"):  # torch's one-time import of its meta kernels (~70 MB), before the baseline
        torch.nn.Embedding(2, 2)
    if engine == "kvchat" and not _is_gguf(a["model"]):  # the file read kvchat's load is compared with
        row["file_read_s"] = round(file_read_seconds(a["model"]), 6)  # small files read in well under 1 ms
    _reset_peak_rss()  # that read's buffer is not the model's memory
    baseline = _rss_now()
    n_new = a["new_tokens"]
    contexts = a["plot_contexts"]
    if engine.startswith("kvchat"):
        mode, group, activations = QUANT.get(precision, ("none", 0, FILE_ACTIVATIONS.get(precision, "float32")))
        dtype = "float32" if precision in QUANT or precision in FILE_ACTIVATIONS else precision
        t0 = now()
        loaded = load_model(
            a["model"], device=str(device), dtype=dtype, weights=mode, group_size=group, activations=activations
        )
        row["load_s"] = round(now() - t0, 3)
        vocab = loaded.config.vocab_size
        prompt = _prompt(a["prompt_tokens"], vocab)
        from ..backends.quantized import weight_bytes

        row.update(
            weight_bytes=loaded.weight_bytes,
            kv_bytes_per_position=loaded.kv_bytes_per_position(),
            weights=loaded.quantization,
            activations=loaded.activations,
            embed_bytes=weight_bytes(loaded.model.embed),
        )
        if engine == "kvchat":
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
                    _sync(device)
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
                _sync(device)
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
        from ..kv_cache import bytes_per_position
        from .llamacpp import LlamaCpp

        cfg = _config(a["model"])
        path = Path(a["gguf"][precision])
        t0 = now()
        lc = LlamaCpp(
            path, n_ctx=max([a["prompt_tokens"] + n_new, *contexts]) + a["plot_tokens"] + 8, threads=a["threads"]
        )
        row["load_s"] = round(now() - t0, 3)
        row["weight_bytes"], row["embed_bytes"] = _gguf_tensor_bytes(path)
        row["kv_bytes_per_position"] = bytes_per_position(cfg, torch.float16)  # its default F16 cache
        vocab = cfg.vocab_size

        def decode(prompt, n):
            lc.L.llama_memory_clear(lc.L.llama_get_memory(lc.ctx), True)
            ids, start, times = lc.generate(prompt, n)
            return _timing(len(prompt), start, times), ids
    else:
        raise ValueError(f"unknown engine {engine!r}")
    if decode is not None:  # the same measurement for every engine: the prompt, then each --plot context
        prompt = _prompt(a["prompt_tokens"], vocab)
        timing, row["token_ids"] = decode(prompt, n_new)
        # Prefill is one short measurement: repeat it (a fresh cache each time) and keep the median run.
        runs = [timing] + [decode(prompt, 1)[0] for _ in range(a["prefill_runs"] - 1)]
        median = sorted(runs, key=lambda t: t["ttft_ms"])[len(runs) // 2]
        timing.update(prefill_tok_s=median["prefill_tok_s"], ttft_ms=median["ttft_ms"])
        row.update(timing, peak_mem_bytes=_peak_mem(device))  # before the --plot contexts
        row["by_context"] = {c: decode(_prompt(c, vocab), a["plot_tokens"])[0]["decode_tok_s"] for c in contexts}
    row.setdefault("peak_mem_bytes", _peak_mem(device))
    row["baseline_mem_bytes"] = baseline if device.type == "cpu" else 0
    return row


def _gguf_tensor_bytes(path: Path) -> tuple[int, int]:
    """All the tensors' bytes in the file, and the embedding's."""
    import gguf

    tensors = gguf.GGUFReader(str(path)).tensors
    embed = next((int(t.n_bytes) for t in tensors if t.name == "token_embd.weight"), 0)
    return sum(int(t.n_bytes) for t in tensors), embed


def _ratio(a, b):
    return None if not a or not b else round(a / b, 3)


def _row(results, engine, precision):
    return next((r for r in results if r["engine"] == engine and r["precision"] == precision and "error" not in r), {})


def ratios(results) -> dict:
    """kvchat against each reference at the matching precision: decode and prefill."""
    out = {}
    for mine, engine, theirs in PAIRS:
        k, ref = _row(results, "kvchat", mine), _row(results, engine, theirs)
        if k and ref:
            key = f"kvchat {mine} / {engine} {theirs}"
            out[key] = {
                "decode": _ratio(k.get("decode_tok_s"), ref.get("decode_tok_s")),
                "prefill": _ratio(k.get("prefill_tok_s"), ref.get("prefill_tok_s")),
            }
    return out


def _is_gguf(model) -> bool:
    from ..weights.gguf_header import is_gguf

    return model is not None and is_gguf(model)


def _config(model):
    """A model's config: from config.json, or from a GGUF file's metadata."""
    from ..config import config_from_dict, load_config

    if _is_gguf(model):
        from ..weights.gguf_file import GGUFModel

        return config_from_dict(GGUFModel(model).config_dict(), Path(model))
    return load_config(Path(model))


def _runs(ns, device_type: str, have_llama: bool, have_hf: bool) -> list[tuple[str, str]]:
    runs = FILE_RUNS if _is_gguf(ns.model) else CUDA_RUNS if device_type == "cuda" else CPU_RUNS
    engines = {e.strip() for e in ns.engines.split(",") if e.strip()}
    unknown = engines - set(ENGINES)
    if unknown:
        raise SystemExit(f"error: unknown engine(s) {', '.join(sorted(unknown))}; choose from {', '.join(ENGINES)}")
    if not have_hf and engines & {"transformers", "transformers-static"}:
        print("transformers is not installed: skipping its rows (pip install -e '.[bench]')", file=sys.stderr)
        engines -= {"transformers", "transformers-static"}
    if not have_llama and "llama.cpp" in engines:
        print(
            "llama-cpp-python or gguf is not installed: skipping llama.cpp (pip install -e '.[bench]')", file=sys.stderr
        )
        engines.discard("llama.cpp")
    precisions = {p.strip() for p in ns.precisions.split(",")} if ns.precisions else None
    wanted = (lambda p: True) if precisions is None else (lambda p: p in precisions or p in FILE_ACTIVATIONS)
    return [(e, p) for e, p in runs if e in engines and wanted(p)]


def run(ns) -> int:
    if ns.plot and importlib.util.find_spec("matplotlib") is None:
        print("error: --plot needs matplotlib (pip install -e '.[bench]')", file=sys.stderr)
        return 2
    report = collect(ns)
    if ns.json:
        print(json.dumps(report))
    elif getattr(ns, "markdown", False):
        print(markdown(report))
    else:
        print_report(report)
    return 0


def collect(ns, progress: bool | None = None) -> dict:
    """Measure every run in its own process; the report `--json` prints."""
    import torch

    from ..devices import default_threads, resolve_device

    progress = (not ns.json) if progress is None else progress
    threads = ns.threads or default_threads()
    timeout = getattr(ns, "row_timeout", None) or ROW_TIMEOUT_S
    torch.set_num_threads(threads)
    device = resolve_device(ns.device)
    have = {m: importlib.util.find_spec(m) is not None for m in ("transformers", "llama_cpp", "gguf")}
    runs = _runs(ns, device.type, have["llama_cpp"] and have["gguf"] and device.type == "cpu", have["transformers"])
    contexts = list(PLOT_CONTEXTS) if ns.plot else []
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-") as tmp:
        model = ns.model or str(write_random_checkpoint(Path(tmp) / ns.shape, ns.shape))
        bandwidth = measure_bandwidth(device)
        gguf_files = {"file": model} if _is_gguf(model) else {}
        if any(e == "llama.cpp" for e, _ in runs) and not gguf_files:
            from .gguf_export import quantize_gguf, write_gguf

            f32 = write_gguf(model, Path(tmp) / "model-F32.gguf")
            gguf_files["F32"] = str(f32)
            for ftype in sorted({p for e, p in runs if e == "llama.cpp"} - {"F32"}):
                got = run_isolated(quantize_gguf, (f32, Path(tmp) / f"model-{ftype}.gguf", ftype, threads), timeout)
                gguf_files[ftype] = got if isinstance(got, dict) else str(got)  # {"error": ...} when it failed
        args = {
            "model": model,
            "device": str(device),
            "prompt_tokens": ns.prompt_tokens,
            "new_tokens": ns.new_tokens,
            "uncached_tokens": ns.uncached_tokens,
            "threads": threads,
            "gguf": gguf_files,
            "plot_contexts": contexts,
            "plot_tokens": ns.plot_tokens,
            "prefill_runs": max(1, getattr(ns, "prefill_runs", 3)),
        }
        results = []
        for engine, precision in runs:
            gguf = gguf_files.get(precision) if engine == "llama.cpp" else None
            if isinstance(gguf, dict):  # its file could not be made: the row says why
                row = {"engine": engine, "precision": precision, "error": f"quantizing: {gguf['error']}"}
            else:
                row = _measure_row(engine, precision, args, timeout)
            results.append(row)
            if progress:
                print(
                    f"  measured {engine} {precision}" + (f": {row['error']}" if "error" in row else ""),
                    file=sys.stderr,
                )
        cfg = _config(model)
    embed_values = cfg.vocab_size * cfg.hidden_size
    context = ns.prompt_tokens + ns.new_tokens / 2  # mean context while decoding
    reference_ids = _row(results, "kvchat", "float32").get("token_ids") or _row(results, "kvchat", "bfloat16").get(
        "token_ids"
    )
    for r in results:
        if "error" in r:
            continue
        eb = r.get("embed_bytes") or embed_values * EMBED_BYTES_PER_VALUE[r["precision"]]
        per_token = bytes_per_token(r["weight_bytes"], eb, cfg.tie_word_embeddings, r["kv_bytes_per_position"], context)
        r["bytes_per_token"] = int(per_token)
        r["roofline_tok_s"] = round(roofline_tok_s(bandwidth, per_token), 2)
        r["roofline_pct"] = (
            None if not r.get("decode_tok_s") else round(100 * r["decode_tok_s"] / r["roofline_tok_s"], 1)
        )
        if reference_ids and r.get("token_ids"):
            n = min(len(reference_ids), len(r["token_ids"]))
            r["same_tokens_as_kvchat"] = sum(a == b for a, b in zip(reference_ids[:n], r["token_ids"][:n]))
        if r["engine"] == "kvchat":
            r["load_vs_file_read"] = round(r["load_s"] / r["file_read_s"], 2) if r.get("file_read_s") else None
            if r.get("peak_mem_bytes") and device.type == "cpu":
                above = r["peak_mem_bytes"] - r["baseline_mem_bytes"]
                r["peak_above_baseline_vs_weights_kv"] = round(above / (r["weight_bytes"] + r["kv_allocated_bytes"]), 3)
        r.pop("token_ids", None)
    report = {
        "model": ns.model or ns.shape,
        "device": str(device),
        "prompt_tokens": ns.prompt_tokens,
        "new_tokens": ns.new_tokens,
        "threads": threads,
        "bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "cpu": cpu_info(),
        "results": results,
        "ratios": ratios(results),
    }
    if ns.plot:
        plot(results, ns.plot, report)
        report["plot"] = ns.plot
    return report


def print_report(report: dict) -> None:
    print(
        f"model {report['model']} · {report['device']} · prompt {report['prompt_tokens']} · "
        f"new {report['new_tokens']} · threads {report['threads']} · copy bandwidth {report['bandwidth_gb_s']} GB/s"
    )
    cpu = report.get("cpu") or {}
    if cpu:
        sets = " ".join(cpu["instruction_sets"]) or "no vector extensions listed"
        print(f"cpu {cpu['model']} · {sets} · {cpu['kernels']}")
    print(
        f"{'engine':20s} {'precision':9s} {'prefill tok/s':>13s} {'TTFT ms':>9s} {'decode tok/s':>12s} "
        f"{'% roofline':>10s} {'peak MiB':>9s} {'load s':>7s} {'load/read':>9s} {'peak/(W+KV)':>11s}"
    )
    for r in report["results"]:
        if "error" in r:
            print(f"{r['engine']:20s} {r['precision']:9s} error: {r['error']}")
            continue
        pct = "—" if r.get("roofline_pct") is None else f"{r['roofline_pct']:.0f}%"
        print(
            f"{r['engine']:20s} {r['precision']:9s} {r['prefill_tok_s']:13.1f} {r['ttft_ms']:9.1f} "
            f"{r['decode_tok_s'] or 0:12.2f} {pct:>10s} {r['peak_mem_bytes'] / 2**20:9.0f} {r['load_s']:7.2f} "
            f"{_x(r.get('load_vs_file_read')):>9s} {_x(r.get('peak_above_baseline_vs_weights_kv')):>11s}"
        )
    for name, v in report["ratios"].items():
        print(f"{name:45s} decode {_x(v['decode'])}  prefill {_x(v['prefill'])}")


def markdown(report: dict) -> str:
    """The report as the Markdown tables README.md keeps."""
    cpu = report.get("cpu") or {}
    head = [f"CPU: {cpu['model']} ({', '.join(cpu['instruction_sets'])}); {cpu['kernels']}", ""] if cpu else []
    rows = head + [
        "| engine | precision | prefill tok/s | TTFT ms | decode tok/s | % of roofline | peak MiB | load s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if "error" in r:
            rows.append(f"| {r['engine']} | {r['precision']} | error: {r['error']} | | | | | |")
            continue
        pct = "—" if r.get("roofline_pct") is None else f"{r['roofline_pct']:.0f}%"
        rows.append(
            f"| {r['engine']} | {r['precision']} | {r['prefill_tok_s']:.1f} | {r['ttft_ms']:.0f} | "
            f"{r['decode_tok_s']:.2f} | {pct} | {r['peak_mem_bytes'] / 2**20:,.0f} | {r['load_s']:.2f} |"
        )
    rows += ["", "| ratio (same run) | decode | prefill |", "|---|---|---|"]
    rows += [f"| {k} | {_x(v['decode'])} | {_x(v['prefill'])} |" for k, v in report["ratios"].items()]
    return "\n".join(rows)


def _x(v) -> str:
    return "—" if v is None else f"{v:.2f}x"


def plot(results: list[dict], path: str, report: dict) -> None:
    """Decode tok/s against context length, one line per engine and precision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"kvchat": "#1f77b4", "transformers": "#ff7f0e", "transformers-static": "#2ca02c", "llama.cpp": "#d62728"}
    styles = {
        "float32": ("-", "o"),
        "F32": ("-", "o"),
        "bfloat16": ("--", "s"),
        "float16": ("--", "D"),
        "F16": ("--", "D"),
        "int8": (":", "^"),
        "Q8_0": (":", "^"),
        "int4": ("-.", "v"),
        "Q4_0": ("-.", "v"),
        "int8/a8": (":", "P"),
        "int4/a8": ("-.", "X"),
    }
    fig, ax = plt.subplots(figsize=(9, 5), dpi=120)
    for r in results:
        points = sorted((int(c), v) for c, v in (r.get("by_context") or {}).items() if v)
        if points:
            line, marker = styles.get(r["precision"], ("-", "o"))
            ax.plot(
                [c for c, _ in points],
                [v for _, v in points],
                linestyle=line,
                marker=marker,
                color=colors.get(r["engine"], "gray"),
                label=f"{r['engine']} {r['precision']}",
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(PLOT_CONTEXTS), [str(c) for c in PLOT_CONTEXTS])
    ax.set_xlabel("context (positions in the KV cache)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title(f"{report['model']} · {report['device']} · {report['threads']} threads")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    raise SystemExit(run(ap.parse_args()))
