"""A Hub that lies, on loopback: names that are paths (an ETag, a commit, a file name), a body that never ends
after a HEAD of 224 bytes, a redirect to another host, a resume answered from byte 0, a drip, listings of
200,000 files. Nothing is written outside the hub cache, nothing runs past its size or its deadline, the token
stays on the Hub's host, and each is a HubError that says what the server did."""

import hashlib
import os

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from hub_standin import COMMIT, HubStandIn, Repo

from engine import hub, hub_transfer
from engine.hub import HubError

SMALL = b"GGUF" + bytes(range(256)) * 2  # an LFS-sized file, small enough to drip


@pytest.fixture
def lying_hub(tmp_path, monkeypatch):
    servers = []

    def start(lies: dict, files: dict | None = None) -> tuple[HubStandIn, str]:
        server = HubStandIn({"evil/repo": Repo(files or {"m.gguf": SMALL}, lies=lies)})
        servers.append(server)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        return server, "evil/repo"

    for k in [k for k in os.environ if k.startswith("HF_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    yield start
    for s in servers:
        s.stop()


def written(tmp_path) -> set[str]:
    """Every path under tmp_path outside the hub cache (the test's own files aside)."""
    return {str(p) for p in tmp_path.rglob("*") if "hub" not in p.relative_to(tmp_path).parts}


def test_names_from_the_hub_are_names_never_paths(lying_hub, tmp_path):
    escape = tmp_path / "escape"
    before = written(tmp_path)
    _, repo = lying_hub({"sha": "../../../../escape/sha_trav"})
    with pytest.raises(HubError, match="commit that is not one"):
        hub.pull(f"{repo}:m.gguf")
    _, repo = lying_hub({"etag": str(escape / "etag_abs")})
    with pytest.raises(HubError, match="ETag that is not a hash"):
        hub.pull(f"{repo}:m.gguf")
    planted = [{"rfilename": str(escape / "abs.gguf"), "size": 3}, {"rfilename": "../up.gguf", "size": 3},
               {"rfilename": "a/./b.gguf", "size": 3}, {"rfilename": "ok/b.gguf", "size": 3}]  # fmt: skip
    _, repo = lying_hub({"siblings": planted})
    commit, files = hub.repo_files(repo)
    assert commit == COMMIT and sorted(f.path for f in files) == ["m.gguf", "ok/b.gguf"]
    with pytest.raises(HubError, match="has no file"):
        hub.pull(f"{repo}:{escape / 'abs.gguf'}")
    assert written(tmp_path) == before and not escape.exists()
    with pytest.raises(HubError, match="outside the hub cache"):
        hub_transfer.inside(tmp_path / "hub", tmp_path / "hub" / ".." / "x")


def test_a_body_past_its_declared_size_stops_there_and_leaves_nothing(lying_hub, tmp_path):
    _, repo = lying_hub({"endless": "m.gguf"})
    with pytest.raises(HubError, match=f"sent more than the {len(SMALL):,} bytes it declared"):
        hub.pull(f"{repo}:m.gguf")
    blobs = tmp_path / "hub" / "models--evil--repo" / "blobs"
    assert list(blobs.iterdir()) == []  # no partial file of the lie left behind


def test_a_download_the_disk_cannot_hold_is_refused_before_it_starts(lying_hub, tmp_path, monkeypatch):
    server, repo = lying_hub({})
    full = type("Usage", (), {"total": 1 << 30, "used": 1 << 30, "free": 1 << 20})()
    monkeypatch.setattr(hub_transfer.shutil, "disk_usage", lambda _p: full)
    with pytest.raises(HubError, match="disk full: m.gguf needs"):
        hub.pull(f"{repo}:m.gguf")
    assert server.tokens == []  # not a byte asked for


def test_the_token_stays_on_the_hubs_host_across_a_redirect(lying_hub, monkeypatch):
    cdn = HubStandIn({"evil/repo": Repo({"m.gguf": SMALL})})
    try:
        _, repo = lying_hub({"redirect": f"http://localhost:{cdn.port}"})  # another host name for loopback
        monkeypatch.setenv("HF_TOKEN", "hf_secret_token_for_the_hub_only")
        path = hub.pull(f"{repo}:m.gguf")
        assert path.read_bytes() == SMALL
        assert cdn.tokens and all(t is None for t in cdn.tokens)  # the bytes came from the other host, no token
    finally:
        cdn.stop()


def test_a_resume_answered_from_byte_0_starts_over_and_never_grows_the_file(lying_hub, tmp_path):
    server, repo = lying_hub({"from_zero": True})
    blobs = tmp_path / "hub" / "models--evil--repo" / "blobs"
    blobs.mkdir(parents=True)
    part = blobs / (hashlib.sha256(SMALL).hexdigest() + ".partial")
    part.write_bytes(SMALL[:100])
    assert hub.pull(f"{repo}:m.gguf").read_bytes() == SMALL
    assert server.ranges["m.gguf"] == ["bytes=100-"]


def test_a_drip_is_given_up_on_at_the_stall_deadline(lying_hub, monkeypatch):
    monkeypatch.setattr(hub_transfer, "STALL_SECONDS", 0.5)
    monkeypatch.setattr(hub_transfer, "STALL_BYTES", 64)
    _, repo = lying_hub({"drip": 0.05})  # 10 bytes in half a second
    with pytest.raises(HubError, match="too slow to go on"):
        hub.pull(f"{repo}:m.gguf")


def test_listings_are_capped_in_rows_and_bytes_and_odd_rows_are_read(lying_hub, monkeypatch):
    many = [{"rfilename": f"part-{i:06d}.gguf", "size": 1} for i in range(200_000)]
    many[0] = {"rfilename": "no-pointer.gguf", "size": 7, "lfs": {"sha256": "0" * 64, "size": 7}}  # no pointerSize
    _, repo = lying_hub({"siblings": many})
    _, files = hub.repo_files(repo)
    assert len(files) == hub.MAX_FILES and files[1].path == "no-pointer.gguf" and files[1].sha256 == "0" * 64
    with pytest.raises(HubError) as e:
        hub.choose(repo, files, None)
    assert len(str(e.value)) < 1000 and f"and {hub.MAX_FILES - 8:,} more" in str(e.value)
    monkeypatch.setattr(hub_transfer, "JSON_BYTES", 1 << 20)
    with pytest.raises(HubError, match="over 1 MiB: refused, not read"):
        hub.repo_files(repo)


def test_a_config_json_that_never_ends_is_read_to_a_megabyte_and_nothing_is_written(lying_hub, tmp_path):
    files = {"config.json": b"{}", "model.safetensors": SMALL}
    _, repo = lying_hub({"endless": "config.json"}, files)
    commit, listed = hub.repo_files(repo)
    facts = hub.repo_facts(repo, commit, listed)
    assert facts.architecture is None or "does not read" in (facts.reason or "")
    assert not (tmp_path / "hub").exists() or not list((tmp_path / "hub").rglob("config.json"))
