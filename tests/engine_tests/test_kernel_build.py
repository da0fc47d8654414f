"""The kernels' build survives its compiler: each C file on its own, a file the compiler crashes on built again a
level lower (its functions all there, the fallback said), a system compiler that fails outright followed by
`zig cc`, and Debian 12's gcc for aarch64 — which crashes at -O3 on the decode step — giving a NEON library with
its dot-product code that agrees with plain C under qemu-aarch64."""

import importlib.util
import os
import platform
import shutil
import stat
import subprocess
import sys

import pytest

from engine.backends import kernel_build, kernels

X86 = platform.machine() in ("x86_64", "AMD64")
CROSS_GCC = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
SELFCHECK = os.path.join(os.path.dirname(__file__), "kernel_selfcheck.c")
ICE = "decode_step.c:53:1: internal compiler error: in vect_transform_reduction, at tree-vect-loop.cc:7457"


def stand_in(tmp_path, body: str):
    """A compiler command: a shell script in front of the system's (as a crashing gcc would behave)."""
    script = tmp_path / "cc-stand-in"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.skipif(not (X86 and shutil.which("gcc")), reason="the stand-in wraps gcc on x86")
def test_a_file_the_compiler_crashes_on_is_built_a_level_lower_and_said(tmp_path, monkeypatch):
    cc = stand_in(
        tmp_path,
        f"""case " $* " in *" -O3 "*decode_step.c*) echo "{ICE}" >&2; exit 4;; esac
exec gcc "$@\"""",
    )
    out = tmp_path / "kernels"
    path = kernel_build.build(cc, (), out)
    said = kernel_build.report(path)
    assert said["levels"]["decode_step.c"] == "-O2" and said["fallbacks"] == {"decode_step.c": [f"-O3: {ICE}"]}
    assert all(level == "-O3" for name, level in said["levels"].items() if name != "decode_step.c")
    assert said["version"].startswith("gcc") and "-fopenmp" in said["flags"]
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    k = kernels._load()  # every function there, checked against torch
    assert k.dtypes and k.modes == {"int8", "int4", "int5", "mxfp4"}
    assert hasattr(k.lib, "kv_decode_batch_f32") and hasattr(k.lib, "kv_decode_layers_f32")  # decode_step.c's
    monkeypatch.setattr(kernels, "_loaded", k)
    monkeypatch.setattr(kernels, "_reason", "")
    assert f"decode_step.c at -O2 (-O3: {ICE})" in kernels.status()


@pytest.mark.skipif(not X86, reason="the zig fallback is checked on x86")
def test_a_system_compiler_that_fails_outright_falls_through_to_zig_cc(tmp_path, monkeypatch):
    if importlib.util.find_spec("ziglang") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("ziglang (the test extra) is missing")
        pytest.skip("ziglang is not installed (pip install -e '.[test]')")
    broken = 'echo "cc: fatal error: cannot execute cc1: No such file or directory" >&2; exit 1'
    cc = stand_in(tmp_path, f'case " $* " in *" --version "*) echo "cc (broken) 1.0"; exit 0;; esac\n{broken}')
    os.replace(cc, tmp_path / "cc")  # the system's cc, first on PATH (CC, when set, names the one to use)
    cc = str(tmp_path / "cc")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert kernel_build.compiler() == [cc]
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    k = kernels._load()
    assert k.compiler == "zig cc" and k.dtypes
    assert k.fell_through.startswith(f"{cc} failed (") and "cannot execute cc1" in k.fell_through
    monkeypatch.setattr(kernels, "_loaded", k)
    monkeypatch.setattr(kernels, "_reason", "")
    assert "so zig cc built them" in kernels.status()


def test_debian_12s_gcc_for_aarch64_builds_neon_with_sdot_that_agrees_under_qemu(tmp_path):
    """The loader's own flags for aarch64 (-O3, -mcpu for a Cortex-A76 as -mcpu=native names it on a Raspberry
    Pi 5, OpenMP), each file on its own with the fallbacks: the library's objects with the self-check, static,
    under qemu: NEON with the dot-product path, equal to plain C from the same compiler."""
    if CROSS_GCC is None or QEMU is None:
        if os.environ.get("CI") == "true" and shutil.which("apt-get"):
            pytest.fail("gcc-aarch64-linux-gnu and qemu-user are installed by .ci/run where apt is available")
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu qemu-user)")
    flags = tuple("-mcpu=cortex-a76" if f == "-mcpu=native" else f for f in kernel_build.target_flags(
        kernel_build.FLAGS, "aarch64"))  # fmt: skip
    outputs, said = {}, {}
    for name, extra in {"neon": (), "generic": ("-DKV_GENERIC",)}.items():
        out = tmp_path / name
        out.mkdir()
        objs, levels, fallbacks = kernel_build.objects([CROSS_GCC], flags + extra, out)
        said[name] = (levels, fallbacks)
        exe = out / "selfcheck"
        link = [CROSS_GCC, "-static", "-fopenmp", f"-I{kernel_build.SOURCES}", *map(str, objs), SELFCHECK, "-lm",
                "-o", str(exe)]  # fmt: skip
        r = subprocess.run(link, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        run = subprocess.run([QEMU, "-cpu", "max", str(exe)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        outputs[name] = run.stdout.strip().splitlines()
    assert outputs["neon"][0] == "isa neon int neon-dotprod" and outputs["generic"][0] == "isa generic int generic"
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump:
        dis = subprocess.run([objdump, "-d", str(tmp_path / "neon" / "selfcheck")], capture_output=True, text=True)
        assert "\tsdot\t" in dis.stdout  # the dot-product instructions are in the build
    ref = {ln.split()[0]: [float(v) for v in ln.split()[2:]] for ln in outputs["generic"][1:]}
    got = {ln.split()[0]: [float(v) for v in ln.split()[2:]] for ln in outputs["neon"][1:]}
    assert got.keys() == ref.keys() and len(ref) >= 40
    for case, want in ref.items():
        scale = max(abs(v) for v in want) or 1.0
        worst = max((abs(a - b) for a, b in zip(got[case], want)), default=0.0) / scale
        assert len(got[case]) == len(want) and worst < 1e-5, (case, worst)
    version = subprocess.run([CROSS_GCC, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    print(f"aarch64 with {version}: levels {said['neon'][0]}, fallbacks {said['neon'][1]}", file=sys.stderr)


@pytest.mark.skipif(not X86, reason="the x86 build with clang")
def test_clang_builds_the_kernels_and_its_openmp_never_runs_beside_torchs(tmp_path):
    """clang (the system compiler on some desktops) builds and checks the kernels; where its OpenMP runtime is
    libomp beside torch's libgomp, they run on one thread and say why, never with two thread pools (before: torch
    ran instead)."""
    if shutil.which("clang") is None:
        if os.environ.get("CI") == "true" and shutil.which("apt-get"):
            pytest.fail("clang is installed by .ci/run where apt is available")
        pytest.skip("clang is not installed (apt-get install clang libomp-dev)")
    code = ("import torch; from engine.backends import kernels, kernel_build; k = kernels.load(); "
            "print(kernels.status()); print(k is not None and bool(k.dtypes) and sorted(k.modes)); "
            "print(sorted(kernel_build.openmp_runtimes()))")  # fmt: skip
    env = {**os.environ, "CC": "clang", "KVCHAT_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    status, modes, runtimes = r.stdout.strip().splitlines()[-3:]
    assert status.startswith("kvchat kernels (") and "built by clang (" in status, status
    assert modes == "['int4', 'int5', 'int8', 'mxfp4']"
    if "libomp" in runtimes and "libgomp" in runtimes:  # both mapped: ours must not run its pool
        assert "one thread: clang's OpenMP runtime (libomp" in status and "is not torch's (libgomp" in status
    print(status, file=sys.stderr)
