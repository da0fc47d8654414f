"""`python -m engine selftest --device cuda --fake`: the GPU path run on fake tensors where no GPU is.

Every check loads a tiny random model through the product's own loader onto a fake `cuda:0` (or `mps:0`) and runs
the session's prefill and decode, the prefix store's copies, several requests on the engine's lanes and CUDA graphs'
capture path up to the capture itself; a device or dtype mismatch fails its check with the engine's line where it
happened. What a decode step waits for on the host is counted per step (the goal: the sampled token only), and the
memory plan builds real shapes' weights, cache and a prefill chunk's activations against a named GPU's memory. A
floor, never a substitute: no value is computed, so no kernel's numbers are checked (selftest without --fake on a
machine with a GPU does that).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import tempfile
import traceback
from collections import Counter
from pathlib import Path

import torch

from .bench.shapes import SHAPES, tiny, write_random_checkpoint
from .fake_device import ENGINE, GPUS, TOOLS, CaptureReached, Watch, fake_device

_WIDE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, max_position_embeddings=4096)
FAMILIES = {  # one of each kind of layer the GPU path runs: dense (tied or not, with q/k/v bias), sliding, mixture
    "llama": tiny("llama", **_WIDE, tie_word_embeddings=False),
    "qwen2": tiny("qwen2", **_WIDE, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "gemma2": dict(
        tiny("llama", **_WIDE),
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        head_dim=32,
        sliding_window=8,
        query_pre_attn_scalar=32,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "qwen3_moe": dict(
        tiny("llama", **_WIDE),
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
}
CAPACITY = 2048  # past a sliding window plus the ring's spare (1024): gemma2's sliding layers keep a ring
PROMPT = tuple(range(5, 45))  # 40 positions, prefilled in chunks of 16
STEPS = 6
LANE_STEPS = 40  # long enough that the three overlap while the later ones prefill beside the first
PLAN_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.1-8b")
PLAN_CHUNK = 512  # a 16-bit model's prefill step (engine.generation.prefill_chunk_for)
DEVICE_DTYPE = {"cuda": "bfloat16", "mps": "float16"}


@dataclasses.dataclass
class Check:
    """One path run on the fake device: what it was, whether it ran through, and what its decode steps waited for."""

    name: str
    ok: bool = True
    error: str | None = None  # the mismatch or failure, with the engine's line where it happened
    decode_path: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    syncs_per_step: dict[str, int] | None = None  # place -> GPU values the host waited for, in a decode step
    uploads_per_step: dict[str, int] | None = None  # place -> copies to the device, in a steady decode step
    waits_allowed: int = 1  # the sampled token; more only where the path is known to read more (and says why)

    def fail(self, why: str) -> None:
        self.ok = False
        self.error = why if self.error is None else f"{self.error}; {why}"


def engine_line(e: BaseException) -> str:
    """The innermost engine line (outside the harness) of an exception's traceback."""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        path = Path(frame.filename)
        if path.is_relative_to(ENGINE) and not path.is_relative_to(TOOLS):
            return f"{path.relative_to(ENGINE.parent)}:{frame.lineno} in {frame.name}"
    return "outside the engine"


def _failure(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:300]} (at {engine_line(e)})"


def _tally(watch: Watch, phases: list[str]) -> tuple[Counter, Counter]:
    """The most syncs and uploads any one of these decode steps made, by place."""
    syncs: Counter = Counter()
    uploads: Counter = Counter()
    for phase in phases:
        step = [e for e in watch.events if e.phase == phase]
        syncs |= Counter(e.place for e in step if e.sync)
        uploads |= Counter(e.place for e in step if e.kind == "to device" and e.device == "cpu")
    return syncs, uploads


def _audit_cache(check: Check, cache, dtype: torch.dtype, device: str) -> None:
    """Every buffer of a cache on the device, in the model dtype where it holds K/V in it (codes: int8/uint8, their
    scales float32)."""
    buffers = cache.buffers()
    for i, buf in enumerate(buffers):
        if buf.device.type != device:
            check.fail(f"cache buffer {i} is on {buf.device}, not {device}")
        want = dtype if not cache.quantized else (torch.float32 if i >= len(buffers) // 2 else None)
        if want is not None and buf.dtype != want:
            check.fail(f"cache buffer {i} is {buf.dtype} in a {dtype} cache")


def run_request(watch: Watch, session, request, check: Check, device: str) -> list:
    """One request through the session (prefill, decode, the store): its events, each decode step's phase its own."""
    from ..events import Failed, Token

    watch.phase, events, phases = "prefill", [], []
    for ev in session.generate(request):
        events.append(ev)
        if isinstance(ev, Token):
            watch.phase = f"{check.name} step {ev.index}"
            phases.append(watch.phase)
        if isinstance(ev, Failed):
            check.fail(f"{ev.kind}: {ev.error.strip().splitlines()[0][:300]}")
    watch.phase = "finish"
    syncs, _ = _tally(watch, phases[:-1])  # every step that fed the next (the last one's token ends the request)
    _, steady = _tally(watch, phases[1:-1])
    _, first = _tally(watch, phases[:1])
    check.syncs_per_step, check.uploads_per_step = dict(syncs), dict(steady)
    once = ", ".join(f"{n}× {p}" for p, n in (first - steady).items())
    if once:
        check.notes.append(f"the first decode step also copies to the device (once): {once}")
    return events


def _load(watch, path, device, dtype, check, **kw):
    from ..weights.loading import load_model

    watch.phase = "load"
    loaded = load_model(path, device=device, dtype=dtype, **kw)
    for name, p in itertools.chain(loaded.model.named_parameters(), loaded.model.named_buffers()):
        if p.device.type != device:
            check.fail(f"{name} is on {p.device} after loading, not {device}")
    loaded.tokenizer.stop_ids = frozenset()
    return loaded


def _generation_checks(watch: Watch, root: Path, device: str, dtype: str) -> list[Check]:
    cases = [(f, "none", "none", False) for f in FAMILIES]
    cases += [("llama", "none", kv, False) for kv in ("int8", "int4")]
    cases += [("llama", w, "none", False) for w in ("int8", "int4")]
    cases += [("llama", "none", "none", True)]  # sampled, with the panel's probabilities
    cases += [("qwen3_moe", "int8", "none", False)]  # quantized experts: not stacked, picked on the host
    return [generation_check(watch, root, device, dtype, *case) for case in cases]


def generation_check(
    watch: Watch, root: Path, device: str, dtype: str, family: str, weights: str, kv: str, sampled: bool
) -> Check:
    """One family at one weight and KV precision, loaded onto the fake device, a request through its session (greedy,
    or sampled with the panel's probabilities), the cache's buffers audited, the prefix store tried on llama."""
    from ..feedforward import MoE
    from ..sampling import SamplingParams
    from ..session import Request, Session

    label = f"{family} {dtype}, weights {weights}, KV {kv}" + (", sampled with probabilities" if sampled else "")
    check = Check(label)
    try:
        loaded = _load(watch, root / family, device, dtype, check, weights=weights)
        session = Session(loaded, capacity=CAPACITY, kv=kv, prefill_chunk=16)
        _audit_cache(check, session.cache, loaded.dtype, device)
        sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=1) if sampled else SamplingParams()
        req = Request(prompt_ids=PROMPT, max_new_tokens=STEPS, sampling=sampling, logprobs=sampled, top_logprobs=3)
        mixtures = sum(isinstance(b.mlp, MoE) and b.mlp.stacked is None for b in loaded.model.layers)
        if mixtures:
            check.waits_allowed += mixtures
            check.notes.append(
                f"known: the experts are not stacked ({weights} codes), so each of {mixtures} mixture layers "
                "reads its router's choice once a step"
            )
        run_request(watch, session, req, check, device)
        check.decode_path = session.decode_path
        if session.graph_error:
            check.notes.append(f"CUDA graph: {session.graph_error}")
        if family == "gemma2":
            check.notes.append(f"cache: {type(session.cache).__name__}")
        if family == "llama" and weights == kv == "none" and not sampled:
            _store_check(watch, session, check, device)
    except Exception as e:  # a mismatch (FakeTensorDeviceMismatchError, a dtype error): the check says where
        check.fail(_failure(e))
    return check


def _store_check(watch: Watch, session, check: Check, device: str) -> None:
    """A second request on the same prompt prefix: its positions come back from the prefix store (copies on the
    device), then an edit within the working cache's positions."""
    from ..events import Finished
    from ..session import Request

    again = Request(prompt_ids=PROMPT[:32] + (99, 98, 97), max_new_tokens=2)
    other = Request(prompt_ids=(60, 61, 62, 63) * 5, max_new_tokens=2)  # evicts the working cache's prompt
    for req in (other, again):
        last = run_request(watch, session, req, Check("store"), device)[-1]
    if not isinstance(last, Finished):
        check.fail(f"the request from the prefix store did not finish: {last}")
    elif last.trace.get("reused", 0) <= 0:
        check.fail("the request from the prefix store reused no position")
    else:
        reused, computed = last.trace["reused"], last.trace["computed"]
        check.notes.append(f"prefix store: {reused} positions returned, {computed} computed")


def _gguf_check(watch: Watch, root: Path, device: str, dtype: str) -> Check:
    from ..session import Request, Session
    from .synthetic_gguf import write

    check = Check(f"GGUF (Q4_K, Q6_K) {dtype}")
    try:
        path = write(root / "synthetic.gguf", hidden=256, layers=2, intermediate=512, vocab=512, heads=4, kv_heads=2)
        loaded = _load(watch, path, device, dtype, check)
        session = Session(loaded, capacity=CAPACITY, prefill_chunk=16)
        run_request(watch, session, Request(prompt_ids=PROMPT, max_new_tokens=STEPS), check, device)
        check.decode_path = session.decode_path
        check.notes.append(f"decode: {loaded.decode_kernels}")
    except Exception as e:
        check.fail(_failure(e))
    return check


def _collect(into: list, ev) -> None:
    from ..scheduler import END

    if ev is not END:
        into.append(ev)


def _lanes_check(watch: Watch, root: Path, device: str, dtype: str) -> Check:
    """Three requests on the engine's lanes, turn by turn in this thread (fake tensors live in the thread that made
    them): their decode steps stepped together, as engine.batching runs them."""
    from ..batching import Lanes
    from ..events import Finished
    from ..scheduler import Ticket
    from ..session import Request, Session

    check = Check(f"3 requests on the engine's lanes, llama {dtype}")
    try:
        loaded = _load(watch, root / "llama", device, dtype, check)
        main = Session(loaded, capacity=CAPACITY, prefill_chunk=16)
        ended, events = [], {i: [] for i in range(3)}
        lanes = Lanes(lambda: main, 3, ended.append)
        lanes.turn_positions, lanes._adjust = 16, lambda *a: None  # a fixed budget: fake time says nothing of speed
        tickets = []
        for i in range(3):
            prompt = tuple(range(5 + 7 * i, 45 + 7 * i))
            sink = functools.partial(_collect, events[i])
            tickets.append(Ticket(Request(prompt_ids=prompt, max_new_tokens=LANE_STEPS + i), sink))
        watch.phase = "lanes"
        for t in tickets:
            lanes.admit(t)
        for _ in range(200):
            if len(ended) == len(tickets):
                break
            lanes.turn()
        done = [ev[-1] for ev in events.values() if ev and isinstance(ev[-1], Finished)]
        if len(done) != len(tickets):
            failed = [str(ev[-1]) for ev in events.values() if ev and not isinstance(ev[-1], Finished)]
            check.fail(f"{len(done)} of {len(tickets)} finished: {'; '.join(failed)[:400]}")
        sizes = sorted({b for d in done for b in d.trace.get("batch_sizes", [])})
        if max(sizes, default=1) < 2:
            check.fail(f"the lanes' decode steps never ran together (batch sizes {sizes})")
        how = "kvchat's batched step" if loaded.model.decode_step is not None else "torch's batched rows"
        pool = main.pool
        shared = f", the KV pool {pool.peak_held} blocks held at most" if pool is not None else ""
        check.notes.append(f"decode turns of {sizes} sequences, in {how}{shared}")
        check.decode_path = main.decode_path
    except Exception as e:
        check.fail(_failure(e))
    return check


def _drafts_check(watch: Watch, root: Path, device: str, dtype: str) -> Check:
    """A reply with lookup drafts over a prompt that repeats itself: the verify pass (the model's forward over the
    chosen token and the drafts) and the rollback of rejected positions, on the device."""
    from ..session import Request, Session

    check = Check(f"speculative decoding (lookup drafts), llama {dtype}")
    script, watch.script = watch.script, itertools.cycle(PROMPT)  # the model "chooses" the prompt again: drafts agree
    try:
        loaded = _load(watch, root / "llama", device, dtype, check)
        session = Session(loaded, capacity=CAPACITY, prefill_chunk=16)
        req = Request(prompt_ids=PROMPT + PROMPT, max_new_tokens=LANE_STEPS, speculative="lookup", ignore_eos=True)
        events = run_request(watch, session, req, check, device)
        spec = (events[-1].trace or {}).get("speculative") if events else None
        if not spec or not spec["drafted"]:
            check.fail("nothing was drafted: the verify pass never ran")
        else:
            check.notes.append(f"{spec['drafted']} drafted in {spec['rounds']} verify passes, {spec['rolled_back']} "
                               "positions rolled back")  # fmt: skip
        if session.cache.length != len(session.ids):
            check.fail(f"the cache holds {session.cache.length} positions for {len(session.ids)} ids")
        check.decode_path = session.decode_path
    except Exception as e:
        check.fail(_failure(e))
    finally:
        watch.script = script
    return check


class ShapeReader:
    """A checkpoint's tensors as shapes only (empty tensors on the device): the product's build path for a memory
    plan of a model no file of which is here."""

    def __init__(self, cfg):
        from ..weights.hf_names import expected
        from ..weights.safetensors import Reader

        self.inner = Reader({n: Path("<shape>") for n in expected(cfg)}, expected(cfg))
        self.inner._opened = staticmethod(lambda path: _Nothing())
        self.inner._copy_into = lambda *a, **k: None

    def read_transposed(self, name, dtype, device):
        rows, cols = self.inner.expected[name]
        return torch.empty((cols, rows), dtype=dtype, device=device)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def memory_plan(watch: Watch, shape: str, device: str, dtype: str, weights: str = "none", capacity: int = 8192):
    """Weights, cache (at `capacity` positions) and a prefill chunk's peak activations of `shape` on the fake device,
    against each named GPU's memory."""
    from ..backends.quantized_model import weight_bytes
    from ..config import config_from_dict
    from ..devices import DTYPES
    from ..kv_cache import make_cache
    from ..quant import DEFAULT_GROUP_SIZE
    from ..weights.build import build_model

    raw = dict(SHAPES[shape], hidden_act="silu", torch_dtype=dtype)
    cfg = config_from_dict(raw)
    dt, dev = DTYPES[dtype], torch.device(device)
    watch.phase = "plan"
    model = build_model(ShapeReader(cfg), cfg, dt, dev, weights, DEFAULT_GROUP_SIZE, None)
    capacity = min(capacity, cfg.max_position_embeddings)
    cache = make_cache(cfg, capacity, dt, dev, "none", PLAN_CHUNK)
    with torch.inference_mode():
        model(torch.zeros((1, 1), dtype=torch.long, device=dev), cache)  # its rotary tables built, as at warm-up
        cache.truncate(0)
        before = watch.reset_peak()
        model(torch.zeros((1, PLAN_CHUNK), dtype=torch.long, device=dev), cache, last_only=True)
        workspace = watch.peak - before
    plan = {
        "shape": shape,
        "dtype": dtype,
        "weights": weights,
        "weight_bytes": weight_bytes(model),
        "capacity": capacity,
        "cache_bytes": cache.allocated_bytes,
        "prefill_chunk": PLAN_CHUNK,
        "workspace_bytes": workspace,
    }
    total = plan["weight_bytes"] + plan["cache_bytes"] + workspace
    plan["total_bytes"] = total
    plan["gpus"] = {
        key: {"name": name, "memory": mem, "fits": total <= mem, "left_bytes": mem - total}
        for key, (name, mem) in GPUS.items()
    }
    return plan


def fake_report(device: str = "cuda", plans: bool = True) -> dict:
    """Every check on a fake `device` ("cuda" or "mps"), and the memory plans: the report selftest --fake prints."""
    dtype = DEVICE_DTYPE[device]
    with tempfile.TemporaryDirectory(prefix="kvchat-fake-") as tmp:
        root = Path(tmp)
        for family, shape in FAMILIES.items():
            write_random_checkpoint(root / family, shape, std=0.2)
        with fake_device(device, "h200", itertools.count(7)) as watch:
            checks = _generation_checks(watch, root, device, dtype)
            checks.append(_gguf_check(watch, root, device, dtype))
            checks.append(_lanes_check(watch, root, device, dtype))
            checks.append(_drafts_check(watch, root, device, dtype))
            graph = [c for c in checks if any("CaptureReached" in n for n in c.notes)]
            if device == "cuda" and not graph:
                checks.append(Check("CUDA graph's capture path", ok=False, error="the capture was never reached"))
            mem = []
            if plans:
                for shape in PLAN_SHAPES:
                    for weights in ("none", "int4"):
                        try:
                            mem.append(memory_plan(watch, shape, device, dtype, weights))
                        except Exception as e:
                            mem.append({"shape": shape, "weights": weights, "error": _failure(e)})
    for c in checks:
        judge(c)
    return {
        "device": f"{device}:0 (fake tensors)",
        "dtype": dtype,
        "torch": torch.__version__,
        "checks": [dataclasses.asdict(c) for c in checks],
        "memory_plans": mem,
        "pass": all(c.ok for c in checks) and not any("error" in p for p in mem),
    }


def judge(check: Check) -> Check:
    """Fail a check whose decode step waited for the GPU more often than its path allows."""
    waits = sum((check.syncs_per_step or {}).values())
    if waits > check.waits_allowed:
        check.fail(
            f"a decode step waits for the GPU {waits} times (at most {check.waits_allowed}): {check.syncs_per_step}"
        )
    return check


def fake_check(device: str, family: str = "llama", weights: str = "none", kv: str = "none", sampled=False) -> Check:
    """One generation check on its own (a family's checkpoint written for it): what a test runs with a bug planted."""
    with tempfile.TemporaryDirectory(prefix="kvchat-fake-") as tmp:
        write_random_checkpoint(Path(tmp) / family, FAMILIES[family], std=0.2)
        with fake_device(device, "h200", itertools.count(7)) as watch:
            check = generation_check(watch, Path(tmp), device, DEVICE_DTYPE[device], family, weights, kv, sampled)
    return judge(check)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def print_report(report: dict) -> None:
    print(f"fake run on {report['device']}, {report['dtype']}, torch {report['torch']}")
    for c in report["checks"]:
        print(("ok   " if c["ok"] else "FAIL ") + c["name"] + (f" [{c['decode_path']}]" if c["decode_path"] else ""))
        if c["error"]:
            print(f"       {c['error']}")
        if c["syncs_per_step"] is not None:
            syncs = ", ".join(f"{n}× {p}" for p, n in c["syncs_per_step"].items()) or "none"
            ups = ", ".join(f"{n}× {p}" for p, n in (c["uploads_per_step"] or {}).items()) or "none"
            print(f"       a decode step waits for: {syncs}; copies to the device: {ups}")
        for n in c["notes"]:
            print(f"       {n}")
    for p in report["memory_plans"]:
        if "error" in p:
            print(f"FAIL plan {p['shape']} weights {p['weights']}: {p['error']}")
            continue
        fits = "; ".join(f"{g['name']}: {'fits' if g['fits'] else 'does not fit'}" for g in p["gpus"].values())
        print(
            f"plan {p['shape']} {p['dtype']}, weights {p['weights']}: weights {_gib(p['weight_bytes'])} + cache "
            f"{_gib(p['cache_bytes'])} ({p['capacity']:,} positions) + a {p['prefill_chunk']}-position prefill's "
            f"activations {_gib(p['workspace_bytes'])} = {_gib(p['total_bytes'])} — {fits}"
        )
    print("passed" if report["pass"] else "FAILED")


__all__ = ["CaptureReached", "fake_check", "fake_report", "memory_plan", "print_report"]
