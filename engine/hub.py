"""Models from the Hugging Face Hub: search, a repository's files with what kvchat can open, and a download into
the standard hub cache (other tools see the files too): resolved by `huggingface_hub`, resumed after a restart,
each LFS file's SHA-256 checked against the Hub's before it is offered, nothing half-written in a snapshot.

The endpoint is huggingface_hub's own (`HF_ENDPOINT`), and so is the token for gated repositories (`HF_TOKEN`
or `hf auth login`). The code here is what runs against the real Hub; the tests run it against a stand-in on
loopback that speaks the same HTTP API.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path

from .devices import free_memory
from .errors import EngineError

FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json")  # fmt: skip
QUANT = re.compile(r"(?i)(?:^|[-_.])((?:I?Q\d(?:_[A-Z0-9]+)*)|F16|BF16|F32)(?=[-_.]|$)")


class HubError(EngineError):
    """The Hub could not be asked, or refused: a message a person can act on."""


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


def _api():
    try:
        from huggingface_hub import HfApi
    except ImportError as e:  # a dependency: only a broken install lacks it
        raise HubError(f"downloading needs huggingface_hub ({e})") from None
    return HfApi(endpoint=endpoint())


def _said(e: Exception, repo: str | None = None) -> HubError:
    """A huggingface_hub or network error as a message a person can act on."""
    from huggingface_hub import errors

    name = type(e).__name__
    what = f" {repo}" if repo else ""
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
        return HubError(f"cannot reach the Hub at {endpoint()}: {e}")
    return HubError(f"the Hub refused: {name}: {e}")


def search(query: str, limit: int = 30) -> list[HubModel]:
    """Text-generation models whose name matches `query`, most downloaded first."""
    try:
        found = list(_api().list_models(search=query, pipeline_tag="text-generation", sort="downloads", limit=limit))
    except Exception as e:  # huggingface_hub raises its own, httpx's and OSError
        raise _said(e) from None
    out = []
    for m in found:
        tags = set(m.tags or ())
        formats = tuple(f for f in ("gguf", "safetensors") if f in tags)
        out.append(HubModel(m.id, m.downloads or 0, m.likes or 0, formats, bool(m.gated), m.pipeline_tag))
    return out


def repo_files(repo: str, revision: str | None = None) -> tuple[str, list[HubFile]]:
    """(the revision's commit, its files with sizes, checksums and what each is)."""
    try:
        info = _api().model_info(repo, revision=revision, files_metadata=True)
    except Exception as e:
        raise _said(e, repo) from None
    files = []
    for s in info.siblings or ():
        name = s.rfilename
        kind = "gguf" if name.endswith(".gguf") else "safetensors" if name.endswith(".safetensors") else "other"
        q = QUANT.search(Path(name).stem) if kind == "gguf" else None
        lfs = s.lfs
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        files.append(HubFile(name, s.size or 0, sha, kind, q.group(1).upper() if q else None))
    return info.sha, files


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


def repo_facts(repo: str, commit: str | None = None, files: list[HubFile] = ()) -> RepoFacts:
    """The architecture (a GGUF repository's from the Hub's summary of its files, a safetensors one's from its
    config), whether kvchat opens it, and, where a config.json is there to read (a few KB), the KV bytes per
    position."""
    from huggingface_hub import hf_hub_download

    from .config import SUPPORTED_ARCHITECTURES, config_from_dict, read_json
    from .weights.catalog import kv_facts
    from .weights.gguf_file import ARCHITECTURES

    try:
        info = _api().model_info(repo, revision=commit, expand=["config", "gguf"])
    except Exception as e:
        raise _said(e, repo) from None
    gguf = getattr(info, "gguf", None) or {}
    if gguf.get("architecture"):
        arch = gguf["architecture"]
        reason = None if arch in ARCHITECTURES else f"GGUF architecture {arch!r} is not supported yet"
        return RepoFacts(arch, reason, None, gguf.get("context_length"))
    arch = ((getattr(info, "config", None) or {}).get("architectures") or [None])[0]
    if arch is None:  # the Hub's summary does not say: known once the files are here
        return RepoFacts(None, None, None, None)
    if arch not in SUPPORTED_ARCHITECTURES:
        return RepoFacts(arch, f"architecture {arch!r} is not supported yet", None, None)
    if not any(f.path == "config.json" for f in files):
        return RepoFacts(arch, None, None, None)
    try:
        path = hf_hub_download(repo, "config.json", revision=commit, endpoint=endpoint(), cache_dir=hub_cache())
        raw = read_json(Path(path))
        cfg = config_from_dict(raw, Path(path))
    except Exception as e:  # a config kvchat cannot read: it would not open either
        return RepoFacts(arch, f"its config.json does not read: {e}", None, None)
    return RepoFacts(arch, None, context=cfg.max_position_embeddings, **kv_facts(cfg))


def choose(repo: str, files: list[HubFile], filename: str | None) -> list[HubFile]:
    """The files a pull of `repo[:filename]` downloads: that GGUF file, or a safetensors folder's weights with
    its config and tokenizer. A repository of several GGUF files needs one named."""
    by_path = {f.path: f for f in files}
    if filename:
        if filename not in by_path:
            raise HubError(f"{repo} has no file {filename}")
        return [by_path[filename]]
    weights = [f for f in files if f.kind == "safetensors" and "/" not in f.path]
    if weights and "config.json" in by_path:
        return [by_path[n] for n in FOLDER_FILES if n in by_path] + weights
    ggufs = [f for f in files if f.kind == "gguf"]
    if len(ggufs) == 1:
        return ggufs
    if ggufs:
        names = ", ".join(f"{f.path} ({f.size / 2**30:,.2f} GiB)" for f in ggufs)
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
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
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
    return last if filename or (len(wanted) == 1 and wanted[0].kind == "gguf") else last.parent


def _download(repo: str, f: HubFile, commit: str, progress: Progress) -> Path:
    """One file into the hub cache's layout (blobs/<etag>, snapshots/<commit>/<path> linked to it, refs/main).
    huggingface_hub resolves it (the commit, the ETag, a token for a gated repository, its errors); the bytes
    go into blobs/<etag>.partial with a ranged GET from what an earlier try left (huggingface_hub's own
    temporary files are per process, so a download it began is not resumed by the next run), and the blob is
    renamed into place only once whole and matching the Hub's SHA-256."""
    import httpx
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    url = hf_hub_url(repo, f.path, revision=commit, endpoint=endpoint())
    meta = get_hf_file_metadata(url)
    root = hub_cache() / f"models--{repo.replace('/', '--')}"
    blob = root / "blobs" / meta.etag
    link = root / "snapshots" / commit / f.path
    if not blob.exists():
        blob.parent.mkdir(parents=True, exist_ok=True)
        part = blob.with_name(blob.name + ".partial")
        have = part.stat().st_size if part.exists() else 0
        headers = build_hf_headers()
        if have:
            headers["Range"] = f"bytes={have}-"
        with httpx.stream("GET", meta.location or url, headers=headers, follow_redirects=True, timeout=60) as r:
            if r.status_code >= 400:
                r.read()
                hf_raise_for_status(r)
            if have and r.status_code != 206:  # the server sent it all again: start over
                have = 0
            progress.add(have)
            with open(part, "ab" if have else "wb") as out:
                for chunk in r.iter_bytes():  # as it arrives: the progress and the partial file follow closely
                    out.write(chunk)
                    progress.add(len(chunk))
                out.flush()
                os.fsync(out.fileno())
        size = part.stat().st_size
        if meta.size is not None and size != meta.size:
            raise HubError(f"{f.path}: the connection dropped at {size:,} of {meta.size:,} bytes; pull again to go on")
        if f.sha256 and sha256_of(part) != f.sha256:
            part.unlink()
            raise HubError(f"{f.path} from {repo} does not match the Hub's checksum: it was refused and removed")
        os.replace(part, blob)
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        try:
            os.symlink(os.path.relpath(blob, link.parent), link)
        except OSError:  # no symlinks (Windows without developer mode): the blob itself, as huggingface_hub does
            os.replace(blob, link)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return link
