"""Builds kvchat's CPU kernels (the C library in csrc/, its ABI in csrc/kernels.h) for this CPU: the compiler
found, the flags of each instruction-set variant, one compiler call into the user cache directory keyed by
source, compiler, flags and CPU (aside, then renamed: other processes never see half a library)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..devices import VARIANT_ENV, cpu_flags
from ..user_cache import user_cache

SOURCES = Path(__file__).with_name("csrc")  # kernels.h (the ABI), simd.h, and one .c file per area
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# The instruction-set variants an x86 build can be forced to (KVCHAT_KERNELS_VARIANT, the tests): the flags
# that take a part away from -march=native. "native" is the default: the best this CPU runs.
X86_VARIANTS = {
    "native": (),
    "avx512-no-vnni": ("-mno-avx512vnni",),  # AVX-512 without VNNI: the 256-bit integer products
    "avx512-no-vbmi": ("-mno-avx512vbmi",),  # the int4 tiles' nibbles by shifts only
    "avx2": ("-mno-avx512f",),
    "avx2-no-vnni": ("-mno-avx512f", "-mno-avxvnni"),  # AVX2's integer products on vpmaddubsw
    "generic": ("-mno-avx512f", "-mno-avx2", "-mno-fma"),  # plain C
}
ARM_VARIANTS = {"native": (), "generic": ("-DKV_GENERIC",)}  # aarch64: NEON (and what -mcpu adds), or plain C
X86 = platform.machine() in ("x86_64", "AMD64")  # where the variants are builds of their own
ARM = platform.machine().lower() in ("aarch64", "arm64")
VARIANTS = X86_VARIANTS if X86 else ARM_VARIANTS if ARM else {"native": ()}
LIBRARY_SUFFIX = {"Windows": ".dll", "Darwin": ".dylib"}.get(platform.system(), ".so")


def target_flags(flags: tuple[str, ...], machine: str | None = None) -> tuple[str, ...]:
    """The build's flags for this machine: ARM compilers name the host CPU with -mcpu (clang refuses
    -march=native there), x86 ones with -march."""
    machine = (machine or platform.machine()).lower()
    if machine in ("aarch64", "arm64"):
        return tuple("-mcpu=native" if f == "-march=native" else f for f in flags)
    return flags


def cache_dir() -> Path:
    """KVCHAT_CACHE_DIR when set, else the platform's user cache directory."""
    return user_cache("kernels")


def compiler() -> list[str] | None:
    """The C compiler's command: CC, else the system's cc, gcc or clang, else `zig cc` where the ziglang
    package is installed (a compiler from PyPI, for machines that have none); None without any."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if found:
        return [found]
    if importlib.util.find_spec("ziglang") is not None:
        return [sys.executable, "-m", "ziglang", "cc"]
    return None


def compiler_name(cc: list[str]) -> str:
    """A compiler's command as a person reads it: `/usr/bin/gcc`, `zig cc`."""
    return "zig cc" if "ziglang" in cc else " ".join(cc)


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags (a cache may be shared)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.processor() + platform.machine()


def sources() -> list[Path]:
    """The library's files: every header and C file in csrc/, in a fixed order."""
    return sorted(p for p in SOURCES.iterdir() if p.suffix in (".c", ".h"))


def variants() -> list[str]:
    """The distinct builds this CPU can execute, best first: on x86 each variant that takes away a part this CPU
    has (one that takes away nothing would be the native build again), then plain C; elsewhere the native build."""
    if not X86:
        return list(VARIANTS)
    have = cpu_flags()
    out = ["native"]
    if "avx512f" in have:
        out += ["avx512-no-vnni"] * ("avx512_vnni" in have) + ["avx512-no-vbmi"] * ("avx512vbmi" in have) + ["avx2"]
    if "avx_vnni" in have:  # AVX-VNNI: AVX2's integer products have a path of their own without it
        out.append("avx2-no-vnni")
    return out + ["generic"]


def variant() -> str:
    """The variant asked for (KVCHAT_KERNELS_VARIANT), "native" when none; an unknown name is an error."""
    name = os.environ.get(VARIANT_ENV, "").strip() or "native"
    if name not in VARIANTS:
        raise RuntimeError(f"{VARIANT_ENV}={name!r} is not a variant here (variants: {', '.join(variants())})")
    return name


def build(
    cc: str | list[str] | None = None,
    extra_flags: tuple[str, ...] = (),
    out_dir: Path | None = None,
    openmp: bool = True,
) -> Path:
    """Compile the kernels (once per source, compiler, flags and CPU) in one compiler call and return the
    library's path. `openmp=False`: without -fopenmp (the pragmas are ignored: one thread), for a compiler
    that has no OpenMP (Apple's clang, clang without libomp)."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or pip install ziglang for zig cc)")
    cc = [cc] if isinstance(cc, str) else list(cc)
    flags = target_flags(tuple(f for f in FLAGS if openmp or f != "-fopenmp")) + tuple(extra_flags)
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    files = sources()
    texts = [f"{p.name}\n{p.read_text()}" for p in files]
    key = hashlib.sha256("\0".join([*texts, *cc, version, *flags, _cpu_signature()]).encode())
    out_dir = out_dir or cache_dir()
    target = out_dir / f"cpu_kernels-{key.hexdigest()[:16]}{LIBRARY_SUFFIX}"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # build aside, then rename: atomic for other processes
        partial = Path(tmp) / target.name
        done = subprocess.run(
            [*cc, *flags, f"-I{SOURCES}", *(str(p) for p in files if p.suffix == ".c"), "-o", str(partial)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler_name(cc)} failed: {done.stderr.strip()[-600:]}")
        os.replace(partial, target)
    return target


def openmp_runtimes() -> set[str]:
    """The OpenMP runtime files mapped into this process (more than one would fight over the cores)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {ln.split()[-1] for ln in maps if ("libgomp" in ln or "libomp" in ln or "libiomp" in ln) and "/" in ln}
