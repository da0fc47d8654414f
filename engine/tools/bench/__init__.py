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
import sys
import tempfile
from pathlib import Path

from .isolation import ROW_TIMEOUT_S, run_isolated
from .machine import cpu_info, measure_bandwidth, measure_read_bandwidth
from .report import PLOT_CONTEXTS, markdown, plot, print_report, ratios, row_of
from .roofline import EMBED_BYTES_PER_VALUE, bytes_per_token, roofline_tok_s
from .rows import CACHED_KVCHAT, FILE_ACTIVATIONS, is_gguf_model, measure_row, model_config
from .shapes import SHAPES, write_random_checkpoint

# kvchat-no-kernels: kvchat where its C kernels cannot be built (KVCHAT_KERNELS=0): torch's kernels only
ENGINES = ("kvchat", "kvchat-no-kernels", "kvchat-uncached", "transformers", "transformers-static", "llama.cpp")


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
    ("kvchat-no-kernels", "float32"),
    ("kvchat-no-kernels", "bfloat16"),
    ("kvchat-no-kernels", "float16"),
    ("kvchat-no-kernels", "int8"),
    ("kvchat-no-kernels", "int4"),
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


# --model FILE.gguf: every engine on that very file
FILE_RUNS = [("kvchat", "file"), ("kvchat", "file/a8"), ("kvchat-no-kernels", "file"), ("llama.cpp", "file")]


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
        "--speculative",
        default=None,
        metavar="int4,lookup,PATH",
        help="speculative decoding instead: each kind of draft against the model alone on a text, an edit and a "
        "code rewrite (engine.tools.spec_bench), llama.cpp's prompt lookup beside lookup where it is installed",
    )
    p.add_argument("--draft-tokens", type=int, default=4, help="with --speculative: tokens drafted a round")
    p.add_argument(
        "--structured",
        action="store_true",
        help="structured output instead: decode with JSON schemas against without (engine.tools.grammar_bench), "
        "llama.cpp's GBNF from the same schemas beside it where it is installed",
    )
    p.add_argument("--rounds", type=int, default=3, help="with --speculative or --structured: runs of each")
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
    p.add_argument(
        "--logprobs-cost",
        action="store_true",
        help="kvchat rows also decode with per-token log-probabilities off, on, and on with 5 alternatives",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="print the tables as Markdown (for engine/BENCHMARKS.md)")


def _runs(ns, device_type: str, have_llama: bool, have_hf: bool) -> list[tuple[str, str]]:
    runs = FILE_RUNS if is_gguf_model(ns.model) else CUDA_RUNS if device_type == "cuda" else CPU_RUNS
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
    if ns.speculative:
        from ..spec_bench import run as speculative

        return speculative(ns)
    if ns.structured:
        from ..grammar_bench import run as structured

        return structured(ns)
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

    from ...devices import default_threads, resolve_device

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
        copy_bandwidth = measure_bandwidth(device)
        bandwidth = measure_read_bandwidth(device)  # the roofline: a decode step reads
        gguf_files = {"file": model} if is_gguf_model(model) else {}
        if any(e == "llama.cpp" for e, _ in runs) and not gguf_files:
            from ..gguf_export import quantize_gguf, write_gguf

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
            "logprobs_cost": getattr(ns, "logprobs_cost", False),
        }
        results = []
        for engine, precision in runs:
            gguf = gguf_files.get(precision) if engine == "llama.cpp" else None
            if isinstance(gguf, dict):  # its file could not be made: the row says why
                row = {"engine": engine, "precision": precision, "error": f"quantizing: {gguf['error']}"}
            else:
                row = measure_row(engine, precision, args, timeout)
            results.append(row)
            if progress:
                print(
                    f"  measured {engine} {precision}" + (f": {row['error']}" if "error" in row else ""),
                    file=sys.stderr,
                )
        cfg = model_config(model)
    embed_values = cfg.vocab_size * cfg.hidden_size
    context = ns.prompt_tokens + ns.new_tokens / 2  # mean context while decoding
    reference_ids = row_of(results, "kvchat", "float32").get("token_ids") or row_of(results, "kvchat", "bfloat16").get(
        "token_ids"
    )
    for r in results:
        if "error" in r:
            continue
        eb = r.get("embed_bytes") or embed_values * EMBED_BYTES_PER_VALUE[r["precision"]]
        read = r.get("read_weight_bytes") or r["weight_bytes"]  # the bytes a token reads: k of E experts in a mixture
        per_token = bytes_per_token(read, eb, cfg.tie_word_embeddings, r["kv_bytes_per_position"], context)
        r["bytes_per_token"] = int(per_token)
        r["roofline_tok_s"] = round(roofline_tok_s(bandwidth, per_token), 2)
        r["roofline_pct"] = (
            None if not r.get("decode_tok_s") else float(f"{100 * r['decode_tok_s'] / r['roofline_tok_s']:.3g}")
        )  # three significant digits: a tiny model's 0.03% is not 0
        if reference_ids and r.get("token_ids"):
            n = min(len(reference_ids), len(r["token_ids"]))
            r["same_tokens_as_kvchat"] = sum(a == b for a, b in zip(reference_ids[:n], r["token_ids"][:n]))
        if r["engine"] in CACHED_KVCHAT:
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
        "bandwidth_gb_s": round(bandwidth / 1e9, 2),  # read
        "copy_bandwidth_gb_s": round(copy_bandwidth / 1e9, 2),
        "cpu": cpu_info(),
        "results": results,
        "ratios": ratios(results),
    }
    if ns.plot:
        plot(results, ns.plot, report)
        report["plot"] = ns.plot
    return report
