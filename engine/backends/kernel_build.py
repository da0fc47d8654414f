"""Builds kvchat's CPU kernels (the C library in csrc/, its ABI in csrc/kernels.h) for this CPU: the compiler
found, the flags of each instruction-set variant, each C file compiled on its own (in parallel) and then linked,
into the user cache directory keyed by source, compiler, flags and CPU (aside, then renamed: other processes
never see half a library). A file the compiler refuses or crashes on is built again a level lower (-O2, then
-O1): only its own functions lose anything, and the build's report (beside the library) says which file, at
which level, and the compiler's first error line."""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import json
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
LEVELS = ("-O3", "-O2", "-O1")  # a file the compiler refuses or crashes on at one level is built at the next
BUILD_FORMAT = "file by file, with a report"  # in the cache key: a library built another way is built again
REPORT = ".build.json"  # beside the library: the compiler, its version, each file's level and any fallback


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
    return zig_cc()


def zig_cc() -> list[str] | None:
    """`zig cc` where the ziglang package is installed: the compiler tried when the system's fails outright."""
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
    """Compile the kernels (once per source, compiler, flags and CPU), each C file on its own with the level
    fallbacks of `objects`, link them, and return the library's path; its report is `report(path)`.
    `openmp=False`: without -fopenmp (the pragmas are ignored: one thread), for a compiler that has no OpenMP
    (Apple's clang, clang without libomp)."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or pip install ziglang for zig cc)")
    cc = [cc] if isinstance(cc, str) else list(cc)
    flags = target_flags(tuple(f for f in FLAGS if openmp or f != "-fopenmp")) + tuple(extra_flags)
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    files = sources()
    texts = [f"{p.name}\n{p.read_text()}" for p in files]
    key = hashlib.sha256("\0".join([*texts, *cc, version, *flags, _cpu_signature(), BUILD_FORMAT]).encode())
    out_dir = out_dir or cache_dir()
    target = out_dir / f"cpu_kernels-{key.hexdigest()[:16]}{LIBRARY_SUFFIX}"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # build aside, then rename: atomic for other processes
        objs, levels, fallbacks = objects(cc, flags, Path(tmp))
        partial = Path(tmp) / target.name
        link = [*cc, *(f for f in flags if not f.startswith("-O")), *(str(o) for o in objs), "-o", str(partial)]
        done = subprocess.run(link, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler_name(cc)} could not link the kernels: {first_error(done.stderr)}")
        said = {"compiler": compiler_name(cc), "version": version.strip().splitlines()[0] if version.strip() else "",
                "flags": list(flags), "levels": levels, "fallbacks": fallbacks}  # fmt: skip
        (Path(tmp) / "report").write_text(json.dumps(said), encoding="utf-8")
        os.replace(Path(tmp) / "report", target.with_name(target.name + REPORT))
        os.replace(partial, target)
    return target


def objects(cc: list[str], flags: tuple[str, ...], out: Path) -> tuple[list[Path], dict, dict]:
    """Each C file compiled on its own, in parallel where cores allow: at the flags' level, and where the
    compiler refuses it or crashes there, at each level of LEVELS below. (the objects, each file's level, each
    fallen-back file's errors, a line a level); a file no level builds fails the build with its errors."""
    given = next((f for f in flags if f.startswith("-O")), LEVELS[0])
    tries = LEVELS[LEVELS.index(given) :] if given in LEVELS else (given,)
    common = [f for f in flags if not f.startswith("-O") and f != "-shared"]
    files = [p for p in sources() if p.suffix == ".c"]

    def one(src: Path) -> tuple[Path, str, list[str]]:
        errors = []
        for level in tries:
            obj = out / f"{src.stem}.o"
            cmd = [*cc, *common, level, f"-I{SOURCES}", "-c", str(src), "-o", str(obj)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                return obj, level, errors
            errors.append(f"{level}: {first_error(done.stderr)}")
        raise RuntimeError(f"{compiler_name(cc)} failed on {src.name} ({'; '.join(errors)})")

    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(files), os.cpu_count() or 1))) as pool:
        built = list(pool.map(one, files))
    levels = {src.name: level for src, (_, level, _) in zip(files, built)}
    fallbacks = {src.name: errors for src, (_, _, errors) in zip(files, built) if errors}
    return [obj for obj, _, _ in built], levels, fallbacks


def first_error(stderr: str) -> str:
    """The compiler's first error line (an internal compiler error, a refused flag), as a person reads it."""
    lines = [ln.strip().replace(f"{SOURCES}{os.sep}", "") for ln in stderr.splitlines() if ln.strip()]
    line = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "no message")
    return line[:240]


def report(library: Path) -> dict:
    """What built `library`: compiler, version, flags, each file's level and any fallback ({} when unknown)."""
    try:
        return json.loads(library.with_name(library.name + REPORT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def report_words(said: dict) -> str:
    """A build's report in a line: the compiler's version, and each file that fell back with its first error."""
    version = said.get("version") or ""
    out = f" ({version})" if version else ""
    for name, errors in (said.get("fallbacks") or {}).items():
        out += f"; {name} at {said['levels'].get(name)} ({errors[0]})"
    return out


def openmp_runtimes() -> set[str]:
    """The OpenMP runtime files mapped into this process (more than one would fight over the cores)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {ln.split()[-1] for ln in maps if ("libgomp" in ln or "libomp" in ln or "libiomp" in ln) and "/" in ln}
