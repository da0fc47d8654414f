"""What is not the product at run time: the benchmark, the GPU selftest, quantization quality, GGUF
export and the llama.cpp reference, and the demo model's corpus, training and evaluation. The
product never imports this package; `python -m engine TOOL` reaches the benchmarks (bench,
store-bench, serve-bench), quality and selftest."""

from __future__ import annotations

import argparse
import sys

TOOLS = ("bench", "store-bench", "serve-bench", "quality", "selftest")


def run_tool(name: str, argv: list[str]) -> int:
    """`python -m engine bench|store-bench|serve-bench|quality|selftest ...`."""
    import torch

    from ..devices import default_threads
    from ..errors import EngineError

    torch.set_num_threads(default_threads())
    if name == "selftest":
        from .selftest import main

        return main(argv)
    if name == "bench":
        from .bench import add_arguments
        from .bench import run as main

        help_text = "prefill/decode speed against references measured in the same run"
    elif name == "store-bench":
        from .store_bench import add_arguments
        from .store_bench import run as main

        help_text = "TTFT on returning to a conversation, with the prefix store and without it"
    elif name == "serve-bench":
        from .serve_bench import add_arguments
        from .serve_bench import run as main

        help_text = "streaming through `engine serve` on loopback against the engine in-process"
    else:
        from .quality import add_arguments, main

        help_text = "compare a quantized model with full precision on the same prompts"
    p = argparse.ArgumentParser(prog=f"python -m engine {name}", description=help_text)
    add_arguments(p)
    try:
        return main(p.parse_args(argv))
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
