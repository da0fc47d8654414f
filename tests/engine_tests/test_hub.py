"""`python -m engine search` and `pull` against a stand-in of the Hugging Face Hub on loopback (HF_ENDPOINT):
search results; a GGUF file and a safetensors folder downloaded into the standard hub cache and opened; a
download killed in the middle and resumed where it stopped, nothing half-written offered meanwhile; a corrupt
file refused and removed; a gated repository without a token, and no Hub at all, said clearly."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from hub_standin import COMMIT, HubStandIn, Repo
from servers import free_port

from engine.tools.gguf_export import write_gguf

FOLDER = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")


def engine(env, *args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "engine", *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.fixture
def hub(tmp_path, demo_model_dir):
    gguf = write_gguf(demo_model_dir, tmp_path / "demo.gguf", "F32", tokenizer=True).read_bytes()
    folder = {n: (demo_model_dir / n).read_bytes() for n in FOLDER if (demo_model_dir / n).exists()}
    repos = {
        "kvchat/demo-GGUF": Repo({"demo-F32.gguf": gguf, "demo-Q4_K_M.gguf": gguf, "README.md": b"# demo"}),
        "kvchat/demo": Repo({**folder, "README.md": b"# demo"}, tags=("safetensors",)),
        "kvchat/gated-GGUF": Repo({"demo-F32.gguf": gguf}, gated=True),
        "kvchat/corrupt-GGUF": Repo({"demo-F32.gguf": gguf}, served={"demo-F32.gguf": gguf[:-64] + b"\0" * 64}),
    }
    server = HubStandIn(repos, trickle=("demo-Q4_K_M.gguf", len(gguf) // 3))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=server.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hub"),
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1")  # fmt: skip
    yield server, env, gguf, tmp_path / "hub"
    server.stop()


def test_search_lists_the_hubs_text_generation_models(hub):
    _, env, _, _ = hub
    r = engine(env, "search", "kvchat", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["repo"]: row for row in json.loads(r.stdout)}
    assert set(rows) == {"kvchat/demo-GGUF", "kvchat/demo", "kvchat/gated-GGUF", "kvchat/corrupt-GGUF"}
    assert rows["kvchat/demo"]["formats"] == ["safetensors"] and rows["kvchat/gated-GGUF"]["gated"]
    assert "kvchat/demo-GGUF  [gguf]  1,000 downloads" in engine(env, "search", "demo-GGUF").stdout


def test_a_gguf_file_and_a_safetensors_folder_are_pulled_into_the_hub_cache_and_open(hub):
    _, env, gguf, cache = hub
    r = engine(env, "pull", "kvchat/demo-GGUF:demo-F32.gguf", "--json")
    assert r.returncode == 0, r.stderr
    path = json.loads(r.stdout)["path"]
    assert path == str(cache / "models--kvchat--demo-GGUF" / "snapshots" / COMMIT / "demo-F32.gguf")
    assert open(path, "rb").read() == gguf and "MiB/s" in r.stderr  # progress: bytes, speed, time left
    several = engine(env, "pull", "kvchat/demo-GGUF")
    assert several.returncode == 2 and "several GGUF files; name one as kvchat/demo-GGUF:FILE" in several.stderr
    assert "demo-Q4_K_M.gguf" in several.stderr
    folder = engine(env, "pull", "kvchat/demo", "--json")
    assert folder.returncode == 0, folder.stderr
    where = json.loads(folder.stdout)["path"]
    assert where == str(cache / "models--kvchat--demo" / "snapshots" / COMMIT)
    assert "README.md" not in os.listdir(where)  # only what the model needs
    for model in (path, where):
        g = engine(env, "generate", "--model", model, "--prompt", "My budget is 600 yuan.", "--max-new-tokens", 4)
        assert g.returncode == 0, g.stderr
    listed = {row["path"]: row for row in json.loads(engine(env, "models", "--json", "--no-cache").stdout)}
    assert listed[path]["openable"] and listed[where]["openable"]  # the app's Models dialog sees them too


def test_a_download_killed_midway_resumes_where_it_stopped_and_nothing_half_written_is_offered(hub):
    server, env, gguf, cache = hub
    proc = subprocess.Popen([sys.executable, "-m", "engine", "pull", "kvchat/demo-GGUF:demo-Q4_K_M.gguf"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    blobs = cache / "models--kvchat--demo-GGUF" / "blobs"
    end = time.monotonic() + 120
    partial = []
    while time.monotonic() < end and not partial:
        partial = [p for p in blobs.glob("*.partial") if p.stat().st_size >= len(gguf) // 3] if blobs.exists() else []
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert partial, "the download never got a third of the way"
    had = partial[0].stat().st_size
    assert 0 < had < len(gguf)
    snapshot = cache / "models--kvchat--demo-GGUF" / "snapshots"
    assert not list(snapshot.glob("*/demo-Q4_K_M.gguf"))  # nothing half-written where a model is looked for
    listed = json.loads(engine(env, "models", "--json", "--no-cache").stdout)
    assert not [row for row in listed if row["path"].endswith("demo-Q4_K_M.gguf")]
    again = engine(env, "pull", "kvchat/demo-GGUF:demo-Q4_K_M.gguf", "--json")
    assert again.returncode == 0, again.stderr
    assert open(json.loads(again.stdout)["path"], "rb").read() == gguf
    resumed = server.ranges["demo-Q4_K_M.gguf"][-1]
    assert resumed is not None and int(resumed.split("=")[1].split("-")[0]) >= had  # from where it stopped


def test_a_corrupt_file_a_gated_repository_and_no_hub_are_said_clearly(hub):
    _, env, _, cache = hub
    bad = engine(env, "pull", "kvchat/corrupt-GGUF:demo-F32.gguf")
    assert bad.returncode == 2 and "does not match the Hub's checksum: it was refused and removed" in bad.stderr
    repo = cache / "models--kvchat--corrupt-GGUF"
    assert not list(repo.glob("snapshots/*/*.gguf")) and not [p for p in repo.glob("blobs/*") if p.is_file()]
    gated = engine(env, "pull", "kvchat/gated-GGUF:demo-F32.gguf")
    assert gated.returncode == 2 and "is gated: accept its terms on the Hub, then log in" in gated.stderr
    missing = engine(env, "pull", "kvchat/nothing-here")
    assert missing.returncode == 2 and "was not found on the Hub" in missing.stderr
    nowhere = dict(env, HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    down = engine(nowhere, "search", "demo")
    assert down.returncode == 2 and f"cannot reach the Hugging Face Hub at {nowhere['HF_ENDPOINT']}" in down.stderr
    assert engine(nowhere, "pull", "owner").returncode == 2  # not a repository: said before anything is asked


def test_the_reach_check_says_at_once_where_the_hub_has_no_address_and_leaves_a_proxy_to_the_request(monkeypatch):
    from engine import hub as hubs

    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://kvchat-no-such-host.invalid")
    began = time.monotonic()
    with pytest.raises(hubs.HubError, match="cannot reach the Hugging Face Hub at https://kvchat-no-such-host"):  # fast
        hubs.reach(2.0)
    assert time.monotonic() - began < 2.5
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # behind a proxy a direct connection proves nothing
    hubs.reach(2.0)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hubs.HubError, match="offline"):
        hubs.reach(2.0)
