"""`python -m engine selftest --device cuda --json`: the engine's own check on a machine with a GPU.

Short (a few minutes) so it fits a small time budget: cached == uncached decoding (float32
exactly; bfloat16 and float16 by token agreement), logits parity with transformers where it is
installed, which decode path ran (CUDA graph or eager, and why), and the benchmark on the
Qwen2.5-0.5B shape in bfloat16 against transformers' dynamic and static caches. `--fake` runs the GPU path on
fake tensors where no GPU is (engine.tools.fake_run): a floor for CI, never a substitute for this run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from .bench.shapes import tiny

# wider than the bench's tiny shape so bfloat16 and float16 have something to disagree on
_WIDER = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, max_position_embeddings=512)
TINY = {
    "llama": tiny("llama", **_WIDER, tie_word_embeddings=False),
    "qwen2": tiny("qwen2", **_WIDER, rope_theta=1000000.0, rms_norm_eps=1e-6),
}


def cached_vs_uncached(model_dir: Path, device: str, dtype: str, steps: int = 24) -> dict:
    from ..session import Request, Session
    from ..weights.loading import load_model

    loaded = load_model(model_dir, device=device, dtype=dtype)
    loaded.tokenizer.stop_ids = frozenset()
    session = Session(loaded, capacity=256, prefill_chunk=16)
    prompt = list(range(5, 45))
    last = list(session.generate(Request(prompt_ids=tuple(prompt), max_new_tokens=steps)))[-1]
    agree, ids = 0, torch.tensor([prompt], device=loaded.device)
    with torch.inference_mode():
        for tok in last.token_ids:
            agree += int(loaded.model(ids, last_only=True)[0, -1].argmax()) == tok  # the whole prefix again
            ids = torch.cat([ids, torch.tensor([[tok]], device=loaded.device)], dim=1)
    n = len(last.token_ids)
    need = n if dtype == "float32" else int(0.9 * n)
    return {
        "dtype": dtype,
        "tokens": n,
        "agree": agree,
        "pass": agree >= need,
        "decode_path": session.decode_path,
        "graph_error": session.graph_error,
    }


def parity_with_transformers(model_dir: Path, device: str, steps: int = 8) -> dict:
    import transformers

    transformers.utils.logging.disable_progress_bar()

    from ..kv_cache import KVCache
    from ..weights.loading import load_model

    ours = load_model(model_dir, device=device, dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    cfg = ours.config
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, torch.float32, ours.device)
    ids = torch.arange(5, 21, device=ours.device)[None]
    worst = 0.0
    with torch.inference_mode():
        mine, want = ours.model(ids, cache), ref(ids).logits
        worst = float((mine - want).abs().max())
        for _ in range(steps):
            nxt = want[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            mine, want = ours.model(nxt, cache), ref(ids).logits
            worst = max(worst, float((mine[:, -1] - want[:, -1]).abs().max()))
    return {"max_abs_logit_diff": worst, "pass": worst < 1e-3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine selftest", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda (default: the best available)")
    ap.add_argument("--shape", default="qwen2.5-0.5b", help="benchmark shape")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-bench", action="store_true", help="checks only")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--fake",
        action="store_true",
        help="the GPU path on fake tensors, where no GPU is: --device cuda or mps (engine/tools/fake_run.py)",
    )
    ap.add_argument("--no-plans", action="store_true", help="with --fake: without the memory plans")
    ns = ap.parse_args(argv)
    if ns.fake:
        return fake(ns)
    from ..devices import resolve_device
    from .bench import collect
    from .bench.shapes import write_random_checkpoint

    device = str(resolve_device(ns.device))
    t0 = time.perf_counter()
    report: dict = {"device": device, "torch": torch.__version__}
    if device == "cpu":
        from ..backends import kernels

        report["decode_kernels"] = kernels.status()
    if device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(0)
    dtypes = ["float32", "bfloat16", "float16"]
    with tempfile.TemporaryDirectory(prefix="kvchat-selftest-") as tmp:
        checks = []
        for name, shape in TINY.items():
            path = write_random_checkpoint(Path(tmp) / name, shape, std=0.2)
            for dt in dtypes:
                checks.append({"model": name, **cached_vs_uncached(path, device, dt)})
            if importlib.util.find_spec("transformers") is not None:
                checks.append(
                    {
                        "model": name,
                        "check": "parity with transformers (float32)",
                        **parity_with_transformers(path, device),
                    }
                )
        report["checks"] = checks
    if not ns.no_bench:
        bench_ns = argparse.Namespace(
            model=None,
            shape=ns.shape,
            device=device,
            threads=None,
            engines="kvchat,kvchat-uncached,transformers,transformers-static",
            precisions="bfloat16",
            prompt_tokens=512,
            new_tokens=ns.new_tokens,
            uncached_tokens=8,
            plot=None,
            plot_tokens=16,
            json=True,
        )
        report["bench"] = collect(bench_ns, progress=False)
    report["pass"] = all(c["pass"] for c in report["checks"])
    report["seconds"] = round(time.perf_counter() - t0, 1)
    if ns.json:
        print(json.dumps(report))
    else:
        for c in report["checks"]:
            print(("ok   " if c["pass"] else "FAIL ") + json.dumps(c))
        if "bench" in report:
            from .bench.report import print_report

            print_report(report["bench"])
        print(f"{'passed' if report['pass'] else 'FAILED'} in {report['seconds']} s")
    return 0 if report["pass"] else 1


def fake(ns) -> int:
    """`--fake`: every check of engine.tools.fake_run on a fake cuda or mps device; 0 when all pass."""
    from .fake_device import FakeDeviceUnavailable
    from .fake_run import fake_report, print_report

    device = ns.device or "cuda"
    if device not in ("cuda", "mps"):
        print(f"selftest --fake: --device must be cuda or mps, not {device!r}", file=sys.stderr)
        return 2
    try:
        report = fake_report(device, plans=not ns.no_plans)
    except FakeDeviceUnavailable as e:
        print(f"selftest --fake: {e}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if report["pass"] else 1
