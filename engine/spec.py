"""What to load and how: one record shared by the app's settings, its worker, the command line and
the loader, so that a load option is declared once."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from .devices import DTYPES
from .disk_store import DiskStore
from .errors import EngineError
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
    activations: str = "float32"  # what quantized weights multiply: float32 (exact) | int8 (decode; prefill in bf16)
    cache_budget: int | None = None  # the prefix store's bytes; None: a share of free memory; 0: no store
    disk_cache: str | None = None  # the prefix store's disk tier, a folder; None: no disk tier
    disk_budget: int | None = None  # its bytes; None: DEFAULT_DISK_BUDGET or a tenth of the free disk; 0: off

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
        session = Session(loaded, capacity=self.capacity, kv=self.kv, cache_budget=self.cache_budget, disk=self.disk())
        return loaded, session

    def disk(self) -> DiskStore | None:
        """The prefix store's disk tier this spec names (None: none, or a budget of 0)."""
        if not self.disk_cache or self.disk_budget == 0:
            return None
        budget = self.disk_budget if self.disk_budget is not None else default_disk_budget(self.disk_cache)
        try:
            return DiskStore(Path(self.disk_cache).expanduser(), budget)
        except OSError as e:
            raise EngineError(f"the disk cache folder {self.disk_cache} cannot be used: {e}") from None

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
            help="what quantized weights multiply: float32 (exact) or int8 (decode: per 32 inputs, integer dot "
            "products; prefill: bfloat16 where the CPU has it — faster, an approximation; measure it with "
            "`python -m engine quality`)",
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
            p.add_argument(
                "--disk-cache",
                default=None,
                metavar="DIR",
                help="keep the prefix store's K/V in this folder too, for later runs (default: none)",
            )
            p.add_argument(
                "--disk-budget",
                type=parse_bytes,
                default=None,
                metavar="BYTES",
                help="the disk tier's size, e.g. 2G (default: 4G or a tenth of the free disk, the smaller; 0: off)",
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
            disk_cache=getattr(ns, "disk_cache", None),
            disk_budget=getattr(ns, "disk_budget", None),
        )


DEFAULT_DISK_BUDGET = 4 * 2**30  # the disk tier's bytes when none is given (or a tenth of the free disk, if less)


def default_disk_budget(folder: str) -> int:
    """DEFAULT_DISK_BUDGET, or a tenth of the disk's free space where that is less."""
    import shutil

    where = Path(folder).expanduser()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return min(DEFAULT_DISK_BUDGET, shutil.disk_usage(where).free // 10)
    except OSError:
        return DEFAULT_DISK_BUDGET


UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str) -> int:
    """A byte count as people write it: 1048576, 512M, 512MiB, 2G, 1.5GB (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (write e.g. 512M or 2G)")
    value = float(m.group(1)) * UNITS[m.group(2).lower()]
    if not value < 2**60:  # an exbibyte: no disk holds it (and 400 nines is inf as a float)
        raise argparse.ArgumentTypeError(f"not a size this machine can hold: {text[:40]!r}")
    return int(value)
