"""Models from the Hugging Face Hub: search, a repository's files with what kvchat can open, and a download into
the standard hub cache (other tools see the files too): resolved by `huggingface_hub`, resumed after a restart,
each LFS file's SHA-256 checked against the Hub's before it is offered, nothing half-written in a snapshot.
What the Hub answers is bounded and checked before it is used (engine/hub_transfer.py).

The endpoint is huggingface_hub's own (`HF_ENDPOINT`), and so is the token for gated repositories (`HF_TOKEN`
or `hf auth login`). The code here is what runs against the real Hub; the tests run it against a stand-in on
loopback that speaks the same HTTP API.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import re
import socket
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, urlsplit

from .devices import free_memory
from .errors import one_line
from .hub_transfer import REPO, HubError, check_commit, check_etag, get_json, inside, is_file_name, transfer

FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json",
                "preprocessor_config.json")  # fmt: skip
QUANT = re.compile(r"(?i)(?:^|[-_.])((?:I?Q\d(?:_[A-Z0-9]+)*)|F16|BF16|F32)(?=[-_.]|$)")
MAX_FILES = 20_000  # a repository's files listed; the rest are left out, and said
CONFIG_BYTES = 1 << 20  # a config.json read before a download
SHA256 = re.compile(r"[0-9a-f]{64}")
REACH_SECONDS = 3.0  # the Hub's name resolved and its port answering within this, or it is said unreachable at once
__all__ = ["HubError", "HubFile", "HubModel", "RepoFacts", "choose", "discard_partial", "fits", "pull", "repo_facts",
           "repo_files", "search"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class HubModel:
    repo: str
    downloads: int
    likes: int
    formats: tuple[str, ...]  # gguf | safetensors, as the repository's tags say
    gated: bool
    pipeline: str | None


@dataclasses.dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    sha256: str | None  # the LFS object's, checked after the download
    kind: str  # gguf | safetensors | other
    quantization: str | None  # from a GGUF file's name: Q4_K_M, Q8_0, F16…

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def endpoint() -> str:
    """The Hub asked: HF_ENDPOINT as it is now (huggingface_hub reads it once, when first imported)."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def hub_cache() -> Path:
    """The hub cache as the environment names it now (HF_HUB_CACHE, else HF_HOME/hub, else the default)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path(constants.HF_HUB_CACHE)


def _said(e: Exception, repo: str | None = None) -> HubError:
    """A huggingface_hub or network error as a message a person can act on."""
    from huggingface_hub import errors

    name = type(e).__name__
    what = f" {repo}" if repo else ""
    if isinstance(e, HubError):
        return HubError(one_line(str(e)))
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return HubError(f"disk full: {one_line(str(e))}")
    if isinstance(e, errors.GatedRepoError):
        return HubError(
            f"the repository{what} is gated: accept its terms on the Hub, then log in (`hf auth login`, or set "
            "HF_TOKEN) and try again"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return HubError(f"the repository{what} was not found on the Hub (or it is private and no token was given)")
    if isinstance(e, errors.EntryNotFoundError):
        return HubError(f"the file was not found in{what}")
    if isinstance(e, (errors.LocalEntryNotFoundError, OSError)) or "Connect" in name or "Timeout" in name:
        return HubError(one_line(f"cannot reach the Hugging Face Hub at {endpoint()}: {e}"))
    return HubError(one_line(f"the Hub refused: {name}: {e}"))


def offline() -> bool:
    """huggingface_hub's switch (HF_HUB_OFFLINE), read as it is now: the Hub is not asked at all."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def reach(timeout: float = REACH_SECONDS) -> None:
    """A HubError at once when the Hub's host does not resolve or its port does not answer within `timeout`
    seconds (a computer without a network otherwise waits on the resolver for tens of seconds)."""
    home = endpoint()
    if offline():
        raise HubError("offline (HF_HUB_OFFLINE is set): the Hub is not asked")
    parts = urlsplit(home)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    if urllib.request.getproxies() and not urllib.request.proxy_bypass(host):
        return  # through a proxy: a direct connection proves nothing; the request itself will say
    said: list = []

    def connect():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            said.append(None)
        except socket.gaierror:
            said.append(f"{host} does not resolve (no network, or no name server)")
        except OSError as e:
            said.append(e)

    t = threading.Thread(target=connect, name="kvchat-hub-reach", daemon=True)  # the resolver has no timeout
    t.start()
    t.join(timeout)
    why = said[0] if said else f"no answer in {timeout:g} s"
    if why is not None:
        raise HubError(one_line(f"cannot reach the Hugging Face Hub at {home}: {why}"))


def _count(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def _ask(path: str, params: dict | None = None, what: str = "the answer", cap: int | None = None):
    """The Hub's JSON at `path` under its endpoint (bounded, redirects without the token elsewhere)."""
    reach()
    home = endpoint().rstrip("/")
    try:
        return get_json(f"{home}{path}", home, params, cap, what)
    except Exception as e:  # huggingface_hub raises its own, httpx's and OSError
        raise _said(e) from None


def search(query: str, limit: int = 30) -> list[HubModel]:
    """Text-generation models whose name matches `query`, most downloaded first."""
    params = {"search": query, "pipeline_tag": "text-generation", "sort": "downloads", "direction": -1, "limit": limit}
    found = _ask("/api/models", params, "the search's answer")
    out = []
    for m in found if isinstance(found, list) else ():
        repo = m.get("id") if isinstance(m, dict) else None
        if not isinstance(repo, str) or not REPO.fullmatch(repo):
            continue  # not a repository's name: never shown, never asked for
        tags = set(t for t in m.get("tags") or () if isinstance(t, str)) if isinstance(m.get("tags"), list) else set()
        formats = tuple(f for f in ("gguf", "safetensors") if f in tags)
        pipeline = m.get("pipeline_tag") if isinstance(m.get("pipeline_tag"), str) else None
        out.append(HubModel(repo, _count(m.get("downloads")), _count(m.get("likes")), formats, bool(m.get("gated")),
                            pipeline))  # fmt: skip
        if len(out) >= limit:
            break
    return out


def _info_path(repo: str, revision: str | None) -> str:
    if not REPO.fullmatch(repo):
        raise HubError(f"not a repository: {one_line(repr(repo), 120)} (write it as owner/name)")
    return f"/api/models/{repo}" + (f"/revision/{quote(revision, safe='')}" if revision else "")


def repo_files(repo: str, revision: str | None = None) -> tuple[str, list[HubFile]]:
    """(the revision's commit, its files with sizes, checksums and what each is). A name that is not a
    relative file name is left out; past MAX_FILES the listing stops."""
    info = _ask(_info_path(repo, revision), {"blobs": "true"}, f"the file list of {repo}")
    if not isinstance(info, dict):
        raise HubError(f"the Hub's answer for {repo} is not a repository's description")
    commit = check_commit(info.get("sha"))
    files = []
    for s in info.get("siblings") or () if isinstance(info.get("siblings"), list) else ():
        name = s.get("rfilename") if isinstance(s, dict) else None
        if not is_file_name(name):
            continue
        kind = "gguf" if name.endswith(".gguf") else "safetensors" if name.endswith(".safetensors") else "other"
        q = QUANT.search(Path(name).stem) if kind == "gguf" else None
        lfs = s.get("lfs") if isinstance(s.get("lfs"), dict) else {}
        sha = lfs.get("sha256") if isinstance(lfs.get("sha256"), str) and SHA256.fullmatch(lfs["sha256"]) else None
        files.append(HubFile(name, _count(s.get("size")), sha, kind, q.group(1).upper() if q else None))
        if len(files) >= MAX_FILES:
            break
    return commit, files


@dataclasses.dataclass(frozen=True)
class RepoFacts:
    """What the Hub says of a repository's model before anything is downloaded."""

    architecture: str | None
    reason: str | None  # why kvchat cannot open it; None: it can
    kv_bytes_per_position: int | None  # 2·L·H_kv·d·b in kvchat's dtype here; None: not known before a download
    context: int | None
    kv_allocated_bytes: int | None = None  # the cache a session allocates by default (sliding layers: their ring)
    kv_layers: str | None = None  # a sliding-window cache's layers in words
    kv_layers_short: str | None = None  # the same for a table's cell
    images: str | None = None  # it sees images: how (its vision side, or the projector file that comes with it)


def repo_facts(repo: str, commit: str | None = None, files: list[HubFile] = ()) -> RepoFacts:
    """The architecture (a GGUF repository's from the Hub's summary of its files, a safetensors one's from its
    config), whether kvchat opens it, and, where a config.json is there to read (a few KB), the KV bytes per
    position."""
    from huggingface_hub import hf_hub_url

    from .config import SUPPORTED_ARCHITECTURES, config_from_dict
    from .vision import VISION_ARCHITECTURES
    from .weights.catalog import kv_facts
    from .weights.gguf_file import ARCHITECTURES

    info = _ask(_info_path(repo, commit), {"expand": ["config", "gguf"]}, f"the summary of {repo}")
    info = info if isinstance(info, dict) else {}
    gguf = info.get("gguf") if isinstance(info.get("gguf"), dict) else {}
    if isinstance(gguf.get("architecture"), str):
        arch = one_line(gguf["architecture"], 80)
        reason = None if arch in ARCHITECTURES else f"GGUF architecture {arch!r} is not supported yet"
        context = gguf.get("context_length")
        projector = best_projector(files)
        images = f"sees images (with {one_line(projector.path, 80)})" if projector else None
        return RepoFacts(arch, reason, None, context if isinstance(context, int) and context > 0 else None,
                         images=images)  # fmt: skip
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    archs = config.get("architectures") if isinstance(config.get("architectures"), list) else [None]
    arch = archs[0] if archs and isinstance(archs[0], str) else None
    if arch is None:  # the Hub's summary does not say: known once the files are here
        return RepoFacts(None, None, None, None)
    if arch not in SUPPORTED_ARCHITECTURES:
        return RepoFacts(one_line(arch, 80), f"architecture {one_line(arch, 80)!r} is not supported yet", None, None)
    if not any(f.path == "config.json" for f in files):
        return RepoFacts(arch, None, None, None)
    home = endpoint().rstrip("/")
    try:  # read into memory, a megabyte at most: nothing is written before a download is asked for
        url = hf_hub_url(repo, "config.json", revision=commit, endpoint=home)
        raw = get_json(url, home, cap=CONFIG_BYTES, what=f"the config.json of {repo}")
        cfg = config_from_dict(raw, Path("config.json"))
    except Exception as e:  # a config kvchat cannot read: it would not open either
        return RepoFacts(arch, one_line(f"its config.json does not read: {e}"), None, None)
    images = "sees images" if arch in VISION_ARCHITECTURES else None
    return RepoFacts(arch, None, context=cfg.max_position_embeddings, images=images, **kv_facts(cfg))


def is_projector(f: HubFile) -> bool:
    """llama.cpp's projector file (mmproj-*.gguf): a model's vision side, not a model."""
    return f.kind == "gguf" and Path(f.path).name.lower().startswith("mmproj")


def best_projector(files: list[HubFile]) -> HubFile | None:
    """The projector file a GGUF model of this repository comes with: its F16 one, else BF16, else the smallest."""
    found = [f for f in files if is_projector(f) and "/" not in f.path]
    for kind in ("f16", "bf16"):  # a word of its name: mmproj-model-f16.gguf, mmproj-BF16.gguf
        named = [f for f in found if kind in re.split(r"[-_.]", Path(f.path).stem.lower())]
        if named:
            return named[0]
    return min(found, key=lambda f: f.size) if found else None


def choose(repo: str, files: list[HubFile], filename: str | None) -> list[HubFile]:
    """The files a pull of `repo[:filename]` downloads: that GGUF file (with the repository's projector file first,
    where it has one: the model then sees images), or a safetensors folder's weights with its config and
    tokenizer. A repository of several GGUF files needs one named."""
    by_path = {f.path: f for f in files}
    projector = best_projector(files)
    if filename:
        if filename not in by_path:
            raise HubError(f"{repo} has no file {filename}")
        chosen = by_path[filename]
        with_projector = projector is not None and not is_projector(chosen) and "/" not in chosen.path
        return ([projector] if with_projector else []) + [chosen]
    weights = [f for f in files if f.kind == "safetensors" and "/" not in f.path]
    if weights and "config.json" in by_path:
        return [by_path[n] for n in FOLDER_FILES if n in by_path] + weights
    ggufs = [f for f in files if f.kind == "gguf" and not is_projector(f)]
    if len(ggufs) == 1:
        return ([projector] if projector is not None and "/" not in ggufs[0].path else []) + ggufs
    if ggufs:
        names = ", ".join(f"{one_line(f.path, 80)} ({f.size / 2**30:,.2f} GiB)" for f in ggufs[:8])
        names += f" and {len(ggufs) - 8:,} more" if len(ggufs) > 8 else ""
        raise HubError(f"{repo} holds several GGUF files; name one as {repo}:FILE — {names}")
    raise HubError(f"{repo} holds neither a safetensors model (config.json and weights) nor a GGUF file")


class Progress:
    """Bytes of one file as they arrive, told to `report(done, total, what)`."""

    def __init__(self, total: int, report: Callable[[int, int, str], None] | None, what: str):
        self.total, self.report, self.what, self.done = total, report, what, 0

    def add(self, n: int) -> None:
        self.done += n
        if self.report:
            self.report(self.done, self.total, self.what)


def discard_partial(repo: str) -> int:
    """Forget what an unfinished download of `repo` left (Cancel): its .partial files; returns how many."""
    blobs = hub_cache() / f"models--{repo.replace('/', '--')}" / "blobs"
    gone = 0
    for p in blobs.glob("*.partial") if blobs.is_dir() else ():
        try:
            p.unlink()
            gone += 1
        except OSError:
            pass
    return gone


def fits(size: int) -> tuple[bool, str]:
    """Whether weights of `size` bytes fit the memory free now (with a fifth spare for the cache and the
    rest), in words."""
    free = free_memory()
    if free is None:  # a system that does not say
        return True, "free memory not known"
    ok = size <= 0.8 * free
    return ok, f"fits ({free / 2**30:,.1f} GiB free)" if ok else f"too big for the {free / 2**30:,.1f} GiB free"


def sha256_of(path: Path, chunk: int = 8 * 2**20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def pull(spec: str, report: Callable[[int, int, str], None] | None = None) -> Path:
    """Download `REPO[:FILE]` into the hub cache and return what `--model` takes: the GGUF file, or the folder.
    A download stopped by a dropped connection or a closed app goes on from where it stopped; each LFS file's
    SHA-256 is checked before it is put where models are looked for."""
    repo, _, filename = spec.partition(":")
    if not REPO.fullmatch(repo):
        raise HubError(f"not a repository: {repo!r} (write it as owner/name, or owner/name:FILE)")
    commit, files = repo_files(repo)
    wanted = choose(repo, files, filename or None)
    total, done, last = sum(f.size for f in wanted), 0, None
    for f in wanted:
        base = done
        tell = (lambda n, t, w, base=base: report(base + n, total, w)) if report else None
        try:
            last = _download(repo, f, commit, Progress(f.size, tell, f.path))
        except HubError:
            raise
        except Exception as e:
            raise _said(e, repo) from None
        done += f.size
    if report:
        report(total, total, "done")
    return last if filename or wanted[-1].kind == "gguf" else last.parent


def _download(repo: str, f: HubFile, commit: str, progress: Progress) -> Path:
    """One file into the hub cache's layout (blobs/<etag>, snapshots/<commit>/<path> linked to it, refs/main).
    huggingface_hub resolves it (the ETag, its size, its errors); every name it gives is checked and every path
    proved inside the repository's folder; the bytes go into blobs/<etag>.partial (engine/hub_transfer.py: a
    resume from what an earlier try left, stopped at the declared size), and the blob is renamed into place
    only once whole and matching the Hub's SHA-256."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    home = endpoint().rstrip("/")
    check_commit(commit)
    if not is_file_name(f.path):
        raise HubError(f"refused: {one_line(repr(f.path), 120)} is not a file name inside a repository")
    url = hf_hub_url(repo, f.path, revision=commit, endpoint=home)
    meta = get_hf_file_metadata(url)
    etag = check_etag(meta.etag)
    size = meta.size if isinstance(meta.size, int) and meta.size >= 0 else f.size
    if f.size and size != f.size:
        raise HubError(f"{f.path}: the Hub lists {f.size:,} bytes and serves {size:,}: refused")
    root = hub_cache() / f"models--{repo.replace('/', '--')}"
    blob = inside(root, root / "blobs" / etag)  # proved before any folder is made for it
    link = root / "snapshots" / commit / f.path
    inside(root, link.parent)
    blob.parent.mkdir(parents=True, exist_ok=True)
    link.parent.mkdir(parents=True, exist_ok=True)
    if not blob.exists():
        part = inside(root, blob.with_name(blob.name + ".partial"))
        transfer(meta.location or url, home, part, size, progress.add, f.path)
        got = part.stat().st_size
        if got != size:
            raise HubError(f"{f.path}: the connection dropped at {got:,} of {size:,} bytes; pull again to go on")
        if f.sha256 and sha256_of(part) != f.sha256:
            part.unlink()
            raise HubError(f"{f.path} from {repo} does not match the Hub's checksum: it was refused and removed")
        os.replace(part, blob)
    if not link.exists():
        try:
            os.symlink(os.path.relpath(blob, link.parent), link)
        except OSError:  # no symlinks (Windows without developer mode): the blob itself, as huggingface_hub does
            os.replace(blob, link)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return link
