"""The benchmark's report: same-run ratios between kvchat and the references, the text and Markdown tables, and
the decode-against-context plot."""

from __future__ import annotations

PLOT_CONTEXTS = (512, 1024, 2048, 4096)  # the decode-against-context plot
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


def _ratio(a, b):
    return None if not a or not b else round(a / b, 3)


def row_of(results, engine, precision):
    return next((r for r in results if r["engine"] == engine and r["precision"] == precision and "error" not in r), {})


def ratios(results) -> dict:
    """kvchat against each reference at the matching precision: decode and prefill; and without the kernels,
    each precision against the same model's float32 on torch (the floor the fallback must hold: half of it)."""
    out = {}
    torch_f32 = row_of(results, "kvchat-no-kernels", "float32")
    for r in results if torch_f32 else ():
        if r["engine"] == "kvchat-no-kernels" and r["precision"] != "float32" and "error" not in r:
            key = f"kvchat-no-kernels {r['precision']} / kvchat-no-kernels float32"
            out[key] = {
                "decode": _ratio(r.get("decode_tok_s"), torch_f32.get("decode_tok_s")),
                "prefill": _ratio(r.get("prefill_tok_s"), torch_f32.get("prefill_tok_s")),
            }
    for mine, engine, theirs in PAIRS:
        k, ref = row_of(results, "kvchat", mine), row_of(results, engine, theirs)
        if k and ref:
            key = f"kvchat {mine} / {engine} {theirs}"
            out[key] = {
                "decode": _ratio(k.get("decode_tok_s"), ref.get("decode_tok_s")),
                "prefill": _ratio(k.get("prefill_tok_s"), ref.get("prefill_tok_s")),
            }
    return out


def print_report(report: dict) -> None:
    print(
        f"model {report['model']} · {report['device']} · prompt {report['prompt_tokens']} · "
        f"new {report['new_tokens']} · threads {report['threads']} · read bandwidth {report['bandwidth_gb_s']} GB/s "
        f"(the roofline; a copy {report.get('copy_bandwidth_gb_s', '—')} GB/s read + write)"
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
    for r in report["results"]:
        if r.get("logprobs_cost"):
            c = r["logprobs_cost"]
            print(
                f"{r['engine']} {r['precision']} decode tok/s with log-probabilities: off {c['off']:.2f} · "
                f"on, k = 0 {c['k0']:.2f} · on, k = 5 {c['k5']:.2f} ({_x(c['k5_vs_off'])} of off)"
            )


def markdown(report: dict) -> str:
    """The report as the Markdown tables engine/BENCHMARKS.md keeps."""
    cpu = report.get("cpu") or {}
    head = [f"CPU: {cpu['model']} ({', '.join(cpu['instruction_sets'])}); {cpu['kernels']}", ""] if cpu else []
    if "bandwidth_gb_s" in report:
        head += [
            f"Read bandwidth {report['bandwidth_gb_s']} GB/s (the roofline), a copy "
            f"{report.get('copy_bandwidth_gb_s', '—')} GB/s (read + write); {report['threads']} threads.",
            "",
        ]
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
