"""What to load and how: one record shared by the app's settings, its worker, the command line and
the loader, so that a load option is declared once."""

from __future__ import annotations

import argparse
import dataclasses
import re

from .devices import DTYPES
from .quant import ACTIVATIONS, DEFAULT_GROUP_SIZE, PRECISIONS
from .session import Session
from .weights.loading import LoadedModel, load_model


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    path: str | None = None  # a model folder or GGUF file; None: the bundled demo model
    device: str | None = None  # cpu | cuda | mps; None: the best available
    dtype: str | None = None  # float32 | bfloat16 | float16; None: bfloat16 on a GPU, float32 on the CPU
    capacity: int | None = None  # KV cache positions; None: min(the model's context, 4096)
    weights: str = "none"  # weight precision: none (the dtype) | int8 | int4
    kv: str = "none"  # KV cache precision: none (the dtype) | int8 | int4
    group_size: int = DEFAULT_GROUP_SIZE  # values per quantization scale; 0: one per output channel
    activations: str = "float32"  # what quantized weights' decode products multiply by: float32 (exact) | int8
    cache_budget: int | None = None  # the prefix store's bytes; None: a share of free memory; 0: no store

    def load(self, progress=None) -> LoadedModel:
        """The model; `progress(fraction, what)` follows the weights being read."""
        return load_model(
            self.path,
            device=self.device,
            dtype=self.dtype,
            weights=self.weights,
            group_size=self.group_size,
            progress=progress,
            activations=self.activations,
        )

    def open(self, progress=None) -> tuple[LoadedModel, Session]:
        """The model and a session over it with this spec's cache."""
        loaded = self.load(progress)
        return loaded, Session(loaded, capacity=self.capacity, kv=self.kv, cache_budget=self.cache_budget)

    def describe(self) -> str:
        """A person's name for what is loaded: the folder, or the bundled demo model."""
        return self.path or "the bundled demo model"

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser, cache: bool = True) -> None:
        """The load options of every `python -m engine` command (`cache`: with --capacity and --kv)."""
        p.add_argument("--model", default=None, help="a model folder or GGUF file (default: the bundled demo model)")
        p.add_argument("--dtype", default=None, choices=list(DTYPES))
        p.add_argument("--device", default=None, help="cpu, cuda, mps (default: the best available)")
        p.add_argument("--weights", default="none", choices=PRECISIONS, help="weight precision")
        p.add_argument(
            "--group-size",
            type=int,
            default=DEFAULT_GROUP_SIZE,
            help="values per quantization scale (0: one per output channel)",
        )
        p.add_argument(
            "--activations",
            default="float32",
            choices=ACTIVATIONS,
            help="what quantized weights multiply in decode: float32 (exact) or int8 (per 32 inputs, integer "
            "dot products: faster, an approximation; measure it with `python -m engine quality`)",
        )
        if cache:
            p.add_argument(
                "--capacity", type=int, default=None, help="KV cache positions (default: min(context, 4096))"
            )
            p.add_argument("--kv", default="none", choices=PRECISIONS, help="KV cache precision")
            p.add_argument(
                "--cache-budget",
                type=parse_bytes,
                default=None,
                metavar="BYTES",
                help="the prefix store's memory, e.g. 512M or 2G (default: a quarter of free memory; 0: none)",
            )

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> LoadSpec:
        return cls(
            path=ns.model,
            device=ns.device,
            dtype=ns.dtype,
            capacity=getattr(ns, "capacity", None),
            weights=ns.weights,
            kv=getattr(ns, "kv", "none"),
            group_size=ns.group_size,
            activations=getattr(ns, "activations", "float32"),
            cache_budget=getattr(ns, "cache_budget", None),
        )


UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """A byte count as people write it: 1048576, 512M, 512MiB, 2G, 1.5GB (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (write e.g. 512M or 2G)")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])
