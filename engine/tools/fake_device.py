"""A GPU that is not there: tensors on `cuda:0` or `mps:0` under torch's FakeTensorMode, on a CPU-only torch.

Fake tensors carry device, dtype and shape through every operator without values, so the GPU path's code runs
where no GPU is: an operator that mixes devices fails as it would on the GPU, and every read of a value (`.item()`,
`int(t)`, `.tolist()`, a copy to the host) is seen by `Watch`, which records where in the engine it happened and
answers it (the sampled token from a script: the one value the run needs). Two things a CPU-only torch lacks are
lent for the run and given back after: a device guard for the fake device (c10's no-op guard, which a CPU-only
build registers for no GPU type; built once here from a few lines of C++ against torch's headers), and
`torch.cuda`'s queries (the GPU's memory is the named GPU's, CUDA graphs' streams are stand-ins and the capture
itself stops the run there).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from ..user_cache import user_cache

aten = torch.ops.aten
ENGINE = Path(__file__).resolve().parents[1]  # engine/: a value read is placed at its innermost frame here
TOOLS = Path(__file__).resolve().parent  # engine/tools/: never the place (it is the harness)

GUARDS_CPP = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
using c10::DeviceType;
template <DeviceType D> static int lend() {  // only where torch has none: a real GPU's guard is never replaced
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(D)];
  if (slot.load() != nullptr) return 0;
  slot.store(new c10::impl::NoOpDeviceGuardImpl<D>());
  return 1;
}
extern "C" int kvchat_lend_guards() { return lend<DeviceType::CUDA>() + 2 * lend<DeviceType::MPS>(); }
"""

GPUS = {  # the memory each named GPU gives its programs, in bytes
    "h200": ("NVIDIA H200", 139 * 2**30),
    "rtx-4090": ("a 24 GiB desktop card (RTX 4090, RTX 3090)", 24 * 2**30),
    "mac-16gb": ("a 16 GB Mac (unified memory, about 2/3 of it for the GPU)", 16 * 10**9 * 2 // 3),
}


class FakeDeviceUnavailable(RuntimeError):
    """The fake device cannot be set up here (no C++ compiler for the guard, or torch's headers missing)."""


class CaptureReached(RuntimeError):
    """A CUDA graph's capture began: everything before it ran on fake tensors; the capture needs a real GPU."""


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def build_guards() -> Path:
    """The no-op device guards' library for this torch, built once into the user cache (kvchat's cache folder)."""
    torch_dir = Path(torch.__file__).parent
    key = hashlib.sha256(f"{torch.__version__}\0{GUARDS_CPP}".encode()).hexdigest()[:16]
    out = user_cache("fake-device") / f"guards-{key}.so"
    if out.is_file():
        return out
    cxx = _compiler()
    if cxx is None:
        raise FakeDeviceUnavailable("no C++ compiler (CXX, c++, g++ or clang++) to build the fake device's guard")
    if not (torch_dir / "include" / "c10").is_dir():
        raise FakeDeviceUnavailable(f"torch's C++ headers are not installed under {torch_dir / 'include'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".cpp")
    src.write_text(GUARDS_CPP)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{torch_dir / 'include'}", str(src), "-o", str(tmp)]
    cmd += [f"-L{torch_dir / 'lib'}", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip()[:300])
        raise FakeDeviceUnavailable(f"the fake device's guard did not build ({cxx}): {first}")
    tmp.replace(out)
    return out


_LENT: set[str] = set()


def lend_guards() -> None:
    """Register no-op device guards for cuda and mps where this torch has none (once a process: they stay; a real
    GPU's guard is never replaced). torch's own for this, torch._C._ensureCUDADeviceGuardSet, leaves a CPU-only
    wheel without one."""
    if not _LENT:
        ctypes.CDLL(str(build_guards())).kvchat_lend_guards()
        _LENT.add("lent")


def engine_place() -> str:
    """Where the engine is now: the innermost frame in engine/ outside the harness, as `engine/file.py:line in f`."""
    frame = sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(ENGINE) and not path.is_relative_to(TOOLS):
            return f"{path.relative_to(ENGINE.parent)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "outside the engine"


@dataclasses.dataclass
class Event:
    """A value the host waited for (a read or a copy to the host), or a copy to the device, in one phase."""

    kind: str  # "read" (a value read on the host: a sync where the tensor is on the GPU), "to host", "to device"
    place: str
    device: str  # where the tensor read or copied lived
    nbytes: int
    phase: str
    count: int = 1  # consecutive values read at one place (a .tolist()) count as one transfer

    @property
    def sync(self) -> bool:
        """Whether the host waits for the GPU here: a value read off the GPU, or a copy of a GPU tensor to the host."""
        return self.kind in ("read", "to host") and self.device != "cpu"


def _dev(t) -> str:
    return t.device.type if isinstance(t, torch.Tensor) else "cpu"


def _all_nonzero(x, *a, **k):
    """nonzero's largest answer, every value nonzero: [numel, dim] indices."""
    return torch.zeros((x.numel(), x.dim()), dtype=torch.long, device=x.device)


def _all_unique(x, sorted=True, return_inverse=False, return_counts=False):
    """unique's largest answer, every value distinct: (values [numel], inverse [shape], counts [numel])."""
    flat = torch.empty((x.numel(),), dtype=x.dtype, device=x.device)
    inverse = torch.zeros(x.shape if return_inverse else (0,), dtype=torch.long, device=x.device)
    counts = torch.ones((x.numel(),) if return_counts else (0,), dtype=torch.long, device=x.device)
    return flat, inverse, counts


WORST_CASE = {aten.nonzero.default: _all_nonzero, aten._unique2.default: _all_unique}  # value-shaped outputs


def _mps_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA on a fake `mps` tensor: a CPU-only build's SDPA picks its kernel for MPS from a table it lacks, so the
    attention runs as torch's math attention (what MPS runs where it has no fused kernel), after the checks
    SDPA itself makes: one dtype for q, k and v, a mask boolean or in that dtype."""
    if not q.dtype == k.dtype == v.dtype:
        raise RuntimeError(f"Expected query, key, and value to have the same dtype: {q.dtype}, {k.dtype}, {v.dtype}")
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, q.dtype):
        raise RuntimeError(f"Expected attn_mask dtype to be bool or {q.dtype}, got {attn_mask.dtype}")
    math = aten._scaled_dot_product_attention_math.default
    return math(q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


class Watch(FakeTensorMode):
    """FakeTensorMode that also records every value read and host-device copy with its place, answers each read (the
    sampled token from `script` where sampling reads it; 0, 0.0 or True elsewhere), and keeps the bytes live on
    the fake device and their peak (views and in-place results own no memory of their own)."""

    SAMPLE_SITE = "engine/sampling.py"
    avoid_device_init = True  # tensors for the device are made on the CPU and lifted, whatever torch.cuda says

    def __init__(self, device: str, script):
        super().__init__(allow_non_fake_inputs=True)
        self.device = device  # "cuda" or "mps"
        self.script = iter(script)
        self.events: list[Event] = []
        self.phase = "load"
        self.live = 0
        self.peak = 0
        self.sampled: list[int] = []
        self._computed = True  # whether an operator made a new tensor since the last event

    def reset_peak(self) -> int:
        self.peak = self.live
        return self.live

    def _record(self, kind: str, t, nbytes: int) -> None:
        """One event; values read one after another at one place with nothing computed between (a .tolist(), whose
        elements are views: under inference_mode a view keeps no `_base` to tell its tensor by) are one transfer."""
        place, device = engine_place(), _dev(t)
        last = self.events[-1] if self.events else None
        if (
            kind == "read"
            and last is not None
            and not self._computed
            and (last.kind, last.place, last.phase)
            == (
                kind,
                place,
                self.phase,
            )
        ):
            last.count += 1
            last.nbytes += nbytes
            return
        self._computed = False
        self.events.append(Event(kind, place, device, nbytes, self.phase))

    def _answer(self, t: torch.Tensor):
        if engine_place().startswith(self.SAMPLE_SITE):
            token = next(self.script)
            self.sampled.append(token)
            return token
        if t.dtype == torch.bool:
            return True
        return 0.0 if t.is_floating_point() else 0

    def _track(self, func, out) -> None:
        """Count the new device tensors `func` made (not its views, nor what it wrote in place) until they die."""
        self._computed = self._computed or not (func.is_view or func is aten.item.default)  # item: the read itself
        returns = func._schema.returns
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, t in enumerate(outs):
            if not isinstance(t, torch.Tensor) or t.device.type != self.device:
                continue
            if i < len(returns) and returns[i].alias_info is not None:
                continue
            n = t.numel() * t.element_size()
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, n)

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is aten.to:  # reaches here under inference_mode: as _to_copy, which fake mode
            out = func.decompose(*args, **kwargs)  # moves to the device without making a real CUDA tensor
            if out is not NotImplemented:
                return out
        if func is aten._local_scalar_dense.default:
            t = args[0]
            self._record("read", t, t.element_size())
            return self._answer(t)
        if func is aten.scaled_dot_product_attention.default and args[0].device.type == "mps":
            with self:
                return _mps_attention(*args, **kwargs)
        if func in WORST_CASE:  # its output's shape depends on the values: the host waits for them
            self._record("read", args[0], 0)
            with self:  # the handler runs with the mode popped: made again under it, the tensors are fake
                return WORST_CASE[func](*args, **kwargs)
        if func is aten._to_copy.default:
            src, dst = _dev(args[0]), torch.device(kwargs.get("device") or args[0].device).type
            if src != dst:
                self._record("to host" if dst == "cpu" else "to device", args[0], args[0].nbytes)
        elif func is aten.copy_.default:
            dst, src = _dev(args[0]), _dev(args[1])
            if src != dst and args[1].dim() > 0:  # a 0-dim CPU value is a scalar argument, not a copy
                self._record("to host" if dst == "cpu" else "to device", args[1], args[1].nbytes)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._track(func, out)
        return out


class _Stream:
    """torch.cuda.Stream's stand-in: waits on nothing (fake tensors have no work in flight)."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Graph:
    """torch.cuda.CUDAGraph's stand-in: the run stops where the capture would begin (CaptureReached)."""

    def replay(self) -> None:
        raise CaptureReached("a CUDA graph was replayed without a capture")


def _capture(*a, **k):
    raise CaptureReached("the CUDA graph's capture began: the step up to it ran; the capture needs a real GPU")


class _RealReads:
    """A safetensors handle (or slice) whose reads run outside the fake mode: the file's bytes are real, and become
    fake where they are copied onto the fake device (safetensors builds its tensors on storages fake mode refuses)."""

    def __init__(self, inner):
        self._inner = inner

    def __enter__(self):
        with unset_fake_temporarily():
            return _RealReads(self._inner.__enter__())

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def __getitem__(self, key):
        with unset_fake_temporarily():
            return self._inner[key]

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def real(*a, **k):
            with unset_fake_temporarily():
                got = attr(*a, **k)
            return got if isinstance(got, (torch.Tensor, list, tuple, dict, str, int, type(None))) else _RealReads(got)

        return real


def _safe_open(*a, **k):
    from safetensors import safe_open

    with unset_fake_temporarily():
        return _RealReads(safe_open(*a, **k))


@contextlib.contextmanager
def fake_device(kind: str, gpu: str, script):
    """Within: tensors made on `kind:0` ("cuda" or "mps") are fake, `torch.cuda`/`torch.backends.mps` say the
    device is there with the named GPU's memory (GPUS), and the Watch it yields sees every operator."""
    if kind not in ("cuda", "mps"):
        raise ValueError(f"a fake device is cuda or mps, not {kind!r}")
    lend_guards()
    memory = GPUS[gpu][1]
    watch = Watch(kind, script)
    with contextlib.ExitStack() as stack:
        patches = [mock.patch("engine.weights.safetensors.safe_open", _safe_open)]
        if kind == "cuda":
            patches += [
                mock.patch.object(torch.cuda, "is_available", lambda: True),
                mock.patch.object(torch.cuda, "_lazy_init", lambda: None),
                mock.patch.object(torch.cuda, "device_count", lambda: 1),
                mock.patch.object(torch.cuda, "get_device_name", lambda *a: GPUS[gpu][0]),
                mock.patch.object(torch.cuda, "mem_get_info", lambda *a: (memory - watch.live, memory)),
                mock.patch.object(torch.cuda, "synchronize", lambda *a: None),
                mock.patch.object(torch.cuda, "Stream", _Stream),
                mock.patch.object(torch.cuda, "current_stream", lambda *a: _Stream()),
                mock.patch.object(torch.cuda, "stream", lambda s: contextlib.nullcontext()),
                mock.patch.object(torch.cuda, "CUDAGraph", _Graph),
                mock.patch.object(torch.cuda, "graph", _capture),
            ]
        else:
            patches += [
                mock.patch.object(torch.backends.mps, "is_available", lambda: True),
                mock.patch.object(torch.mps, "synchronize", lambda *a: None),
            ]
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(watch)
        yield watch
