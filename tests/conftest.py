import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

from checkpoints import make_checkpoint  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """One tiny Llama checkpoint shared by the tests that only read it."""
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", generation_eos=[1])


@pytest.fixture(scope="session")
def demo_model_dir():
    from engine.weights.bundled import DEMO_MODEL

    if not (DEMO_MODEL / "model.safetensors").is_file():
        pytest.fail(f"the bundled demo model is missing from {DEMO_MODEL}")
    return DEMO_MODEL


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real SmolLM2-135M-Instruct Q4_1 GGUF that tests/fetch_models.py put in the cache (skipped
    without it; under CI=true its absence is a failure: CI fetches it first)."""
    from fetch_models import SIZE, smollm2_path

    path = smollm2_path()
    if not (path.is_file() and path.stat().st_size == SIZE):
        message = f"{path} is missing: run python tests/fetch_models.py"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture
def serve(tmp_path):
    """serve(*args): a real `python -m engine serve` on a free loopback port (the demo model unless
    --model is given); every one started is stopped at the test's end."""
    from servers import engine_serve

    started = []

    def start(*args):
        server = engine_serve(tmp_path, *args)
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def scripted_server():
    """scripted_server(mode=..., model=...): an in-process OpenAI-compatible server that behaves as told."""
    from servers import ScriptedServer

    started = []

    def start(**kw):
        started.append(ScriptedServer(**kw))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def _variants() -> list[str]:
    from engine.backends import kernel_build

    return kernel_build.variants()


@pytest.fixture(params=_variants())
def kernel_variant(request, monkeypatch):
    """Each instruction-set variant of the kernels this CPU can execute (engine.backends.kernel_build.variants:
    AVX-512 and its parts, AVX2, plain C on x86): the model loads in the test run on that build
    (KVCHAT_KERNELS_VARIANT), so the end-to-end parity tests hold every path a user's CPU may take, not
    only this machine's best. The variant's build is checked as the app checks it, and must pass; the
    fixture's value is the loaded kernels (their `variant` names it)."""
    from engine import devices
    from engine.backends import kernels

    monkeypatch.setenv(devices.VARIANT_ENV, request.param)
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernels, "_reason", None)
    k = kernels.load()
    if k is None and request.param == "native":  # no compiler here: nothing to vary
        pytest.skip(f"no kernels here: {kernels.status()}")
    assert k is not None and k.variant == request.param, kernels.status()
    return k
