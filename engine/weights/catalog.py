"""The models already on this machine: the Hugging Face hub cache, LM Studio's and Ollama's folders,
and folders a person added — one row each, with what it is and whether kvchat can open it.

Only headers are read (config.json and safetensors headers, GGUF metadata), never weights. GGUF
metadata is slow to read for a large vocabulary, so rows are kept in a small JSON cache keyed by
each file's path, size and modification time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

from ..config import config_from_dict, read_json
from ..devices import resolve_device, resolve_dtype
from ..errors import ModelLoadError
from ..kv_cache import cache_plan
from ..vision import vision_config
from .gguf_file import ARCHITECTURES, GGUFModel
from .gguf_header import is_gguf
from .gguf_reader import check_gguf_shapes
from .hf_names import check_shapes
from .mmproj import is_projector_file, projector_beside
from .safetensors import text_model_names

SOURCES = ("hf-cache", "lm-studio", "ollama", "folder")
CACHE_VERSION = 6


@dataclasses.dataclass(frozen=True)
class FoundModel:
    name: str
    path: str  # what `--model` takes: a model folder or a GGUF file
    source: str  # hf-cache | lm-studio | ollama | folder
    format: str  # safetensors | gguf
    architecture: str | None
    parameters: int | None
    quantization: str | None  # the weights' type as stored: bf16, F16, Q4_K, ...
    size_bytes: int
    openable: bool
    reason: str | None = None  # why not, when it cannot be opened
    kv_bytes_per_position: int | None = None  # 2·L·H_kv·d·b in the dtype kvchat loads it in here
    kv_allocated_bytes: int | None = None  # the cache a session allocates by default (sliding layers: their ring)
    kv_layers: str | None = None  # a sliding-window cache's layers in words ("22 of 26 layers sliding: ≤ 1,536 …")
    kv_layers_short: str | None = None  # the same for a table's cell ("22/26 sliding ≤ 1,536")
    held_bytes: int | None = None  # the weights once loaded, where it differs from the file's size (a GGUF's)
    images: str | None = None  # it sees images: how (its vision family, or the projector file beside a GGUF)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def roots(env=None, home: Path | None = None) -> dict[str, list[Path]]:
    """Where each source keeps its models, as the tools themselves decide it."""
    env = os.environ if env is None else env
    home = Path.home() if home is None else Path(home)
    hub = env.get("HF_HUB_CACHE") or (str(Path(env["HF_HOME"]) / "hub") if env.get("HF_HOME") else None)
    return {
        "hf-cache": [Path(hub) if hub else home / ".cache" / "huggingface" / "hub"],
        "lm-studio": [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"],
        "ollama": [Path(env["OLLAMA_MODELS"]) if env.get("OLLAMA_MODELS") else home / ".ollama" / "models"],
    }


# --- reading one candidate ------------------------------------------------------------------------
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
DTYPE_BYTES |= {"F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def _safetensors_header(path: Path) -> dict:
    """The header, each tensor's extent checked against the file: a header that claims more bytes than
    the file holds (a forged 2^62 × 2^62 shape) is an error here, not a row that says it opens."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("too short for a safetensors file")
        n = struct.unpack("<Q", head)[0]
        if n > min(100_000_000, size - 8):
            raise ValueError("its header size runs past the end of the file")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    data = size - 8 - n
    for name, t in header.items():
        if name == "__metadata__":
            continue
        t = t if isinstance(t, dict) else {}
        shape, offsets = t.get("shape"), t.get("data_offsets")
        ok = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) and t.get("dtype") in DTYPE_BYTES
        ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        if not ok:
            raise ValueError(f"tensor {name!r} has no readable dtype, shape and offsets")
        begin, end = offsets
        want = math.prod(shape) * DTYPE_BYTES[t["dtype"]]
        if not 0 <= begin <= end <= data or end - begin != want:
            raise ValueError(f"tensor {name!r} claims {want:,} bytes at {begin:,}–{end:,}; the file holds {data:,}")
    return header


def _folder_row(folder: Path, name: str, source: str) -> FoundModel:
    """A Hugging Face style folder: config.json, safetensors (one file or shards), tokenizer.json."""
    files = sorted(folder.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in files if p.exists())
    arch = params = quant = None
    reason, kv = None, {}
    try:
        raw = read_json(folder / "config.json")
        arch = (raw.get("architectures") or [None])[0]
        cfg = config_from_dict(raw, folder / "config.json")
        kv = kv_facts(cfg)
        if not files:
            raise ModelLoadError("no safetensors weights (pickle .bin files are never opened)")
        counts: dict[str, int] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for p in files:
            for key, t in _safetensors_header(p).items():
                if key == "__metadata__":
                    continue
                shapes[key] = tuple(t["shape"])
                kind, n = t["dtype"], math.prod(t["shape"])
                if key.endswith(("_blocks", "_scales")):  # MXFP4 (gpt-oss's experts): two values a byte, and scales
                    kind, n = "MXFP4", 2 * n if key.endswith("_blocks") else 0
                counts[kind] = counts.get(kind, 0) + n
        params = sum(counts.values())
        quant = max(counts, key=counts.get).lower() if counts else None
        stored = text_model_names(dict.fromkeys(shapes))  # a multimodal checkpoint's text model
        usual = {mine: shapes[theirs] for mine, theirs in stored.items()} | {
            k: v for k, v in shapes.items() if not stored or k == "lm_head.weight"
        }
        check_shapes(cfg, usual, lambda name: stored.get(name, name))
        if not (folder / "tokenizer.json").is_file():
            raise ModelLoadError("no tokenizer.json")
        seeing = vision_config(raw, cfg.hidden_size, folder / "config.json")
        if seeing is not None:
            unit = "a tile" if seeing.family == "idefics3" else "an image"
            many = (
                f"{seeing.tokens_per_image} positions {unit}"
                if seeing.tokens_per_image
                else "a position a 28-pixel cell"
            )
            kv["images"] = f"sees images ({seeing.family}: {many})"
    except (ModelLoadError, OSError, ValueError, KeyError, TypeError) as e:
        reason = e.message if isinstance(e, ModelLoadError) else f"{type(e).__name__}: {e}"
    return FoundModel(name, str(folder), source, "safetensors", arch, params, quant, size, reason is None, reason, **kv)


def kv_facts(cfg) -> dict:
    """A model's cache figures before it is opened (a row here, a Hub repository's facts): in the dtype kvchat loads
    models in on this machine, at the default capacity."""
    plan = cache_plan(cfg, resolve_dtype(None, resolve_device(None)))
    return {
        "kv_bytes_per_position": plan["bytes_per_position"],
        "kv_allocated_bytes": plan["allocated_bytes"],
        "kv_layers": plan["layers"],
        "kv_layers_short": plan["layers_short"],
    }


def bundled_row() -> FoundModel:
    """The bundled demo model, as a row: always there, whatever else is on the machine."""
    from .bundled import DEMO_MODEL

    return _folder_row(DEMO_MODEL, "kvchat-demo", "bundled")


def is_bundled(path: str | None) -> bool:
    """Whether a model path names the bundled demo model (None does: it is the default)."""
    from .bundled import DEMO_MODEL

    return path is None or Path(path).resolve() == DEMO_MODEL.resolve()


def _gguf_row(path: Path, name: str, source: str) -> FoundModel:
    size = path.stat().st_size
    try:
        gm = GGUFModel(path, check_architecture=False)
    except ModelLoadError as e:
        return FoundModel(name, str(path), source, "gguf", None, None, None, size, False, e.message)
    params = sum(int(t.n_elements) for t in gm.file_tensors)  # a mixture's experts once, as stored
    kind = gm.meta("tokenizer.ggml.model")
    reason, kv, held = None, {}, None
    if gm.arch not in ARCHITECTURES:
        reason = f"GGUF architecture {gm.arch!r} is not supported"
    elif kind not in ("gpt2", "llama"):
        reason = f"tokenizer model {kind!r} is not supported"
    else:
        try:
            cfg = config_from_dict(gm.config_dict(), path)
            check_gguf_shapes(gm, cfg)
            kv, held = kv_facts(cfg), gm.held_estimate(cfg)
        except ModelLoadError as e:
            reason = e.message
    quant = gm.quantization()
    projector = projector_beside(path)
    images = f"sees images with {projector.name}" if projector is not None else None
    return FoundModel(name, str(path), source, "gguf", gm.arch, params, quant, size, reason is None, reason, **kv,
                      held_bytes=held, images=images)  # fmt: skip


FIELDS = {f.name for f in dataclasses.fields(FoundModel)}


class _RowCache:
    """Rows by (path, size, mtime) in a JSON file, so a second scan reads no GGUF metadata again."""

    def __init__(self, path: Path | None):
        self.path, self.rows, self.dirty = path, {}, False
        if path is not None and path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if data.get("version") == CACHE_VERSION and isinstance(data["rows"], dict):
                    self.rows = data["rows"]
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
                self.rows = {}  # a cache that cannot be read is only a slower scan

    @staticmethod
    def key(path: Path) -> str:
        st = path.stat()
        return f"{path}|{st.st_size}|{st.st_mtime_ns}"

    def row(self, path: Path, make: Callable[[], FoundModel], name: str, source: str) -> FoundModel:
        key = self.key(path)
        got = self.rows.get(key)
        if isinstance(got, dict) and set(got) == FIELDS:
            try:
                return FoundModel(**{**got, "name": name, "source": source})
            except TypeError:  # a tampered row: read the file again
                pass
        row = make()
        self.rows[key] = row.to_dict()
        self.dirty = True
        return row

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"version": CACHE_VERSION, "rows": self.rows}), encoding="utf-8")
            tmp.replace(self.path)
        except OSError:
            pass  # a cache that cannot be written only makes the next scan slower


def _skipped(path: Path, name: str, source: str, reason: str) -> FoundModel:
    """A row for an entry that could not be read at all: shown with its reason, and the scan goes on."""
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    return FoundModel(name, str(path), source, "unknown", None, None, None, size, False, reason)


# --- the sources ------------------------------------------------------------------------------------
def _candidates_in(folder: Path, depth: int = 3) -> Iterator[tuple[Path, str]]:
    """(model folder or GGUF file, its kind) below `folder`, at most `depth` levels down."""
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        yield folder, "safetensors"
    for p in entries:
        if p.is_file() and p.suffix.lower() == ".gguf" and not is_projector_file(p) and is_gguf(p):
            yield p, "gguf"  # (a projector file is its model's vision side, named in the model's row)
        elif p.is_dir() and depth > 0 and not p.name.startswith("."):
            yield from _candidates_in(p, depth - 1)


def _hf_cache(root: Path) -> Iterator[tuple[Path, str, str]]:
    """models--ORG--NAME/snapshots/REV: the revision refs/main names, else the newest snapshot."""
    for repo in sorted(root.glob("models--*")):
        name = repo.name[len("models--") :].replace("--", "/")
        snaps = repo / "snapshots"
        ref = repo / "refs" / "main"
        snap = None
        try:
            rev = ref.read_text(encoding="utf-8").strip() if ref.is_file() else ""
        except (OSError, ValueError):  # unreadable, or not text: the newest snapshot instead
            rev = ""
        if rev and "/" not in rev and rev not in (".", ".."):
            snap = snaps / rev if (snaps / rev).is_dir() else None
        if snap is None:
            dirs = [d for d in snaps.glob("*") if d.is_dir()] if snaps.is_dir() else []
            snap = max(dirs, key=lambda d: d.stat().st_mtime) if dirs else None
        if snap is None:
            continue
        for path, kind in _candidates_in(snap, depth=1):
            yield path, kind, name if kind == "safetensors" else f"{name}/{path.name}"


def _ollama(root: Path) -> Iterator[tuple[Path, str, str] | FoundModel]:
    """manifests/HOST/NAMESPACE/MODEL/TAG (JSON) name a GGUF blob in blobs/ by its digest; a manifest that
    cannot be read is a row with its reason."""
    manifests = root / "manifests"
    for manifest in sorted(p for p in manifests.glob("*/*/*/*") if p.is_file()):
        host, namespace, model, tag = manifest.relative_to(manifests).parts
        name = (model if namespace == "library" else f"{namespace}/{model}") + f":{tag}"
        try:
            layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
            digest = next((la["digest"] for la in layers if str(la.get("mediaType", "")).endswith(".model")), None)
            if digest is not None and not (isinstance(digest, str) and digest.replace(":", "-").isprintable()):
                raise ValueError(f"its model digest is {digest!r}")
        except (OSError, ValueError, AttributeError, TypeError, KeyError) as e:  # this entry only
            yield _skipped(manifest, name, "ollama", f"its manifest cannot be read ({type(e).__name__}: {e})")
            continue
        if not digest or "/" in digest:
            continue
        blob = root / "blobs" / digest.replace(":", "-")
        if host != "registry.ollama.ai":
            name = f"{host}/{name}"
        if blob.is_file():
            yield blob, "gguf", name


def scan(folders=(), env=None, home: Path | None = None, cache: Path | None = None) -> Iterator[FoundModel]:
    """Every model found, source by source (rows as they are read: a caller may show them as they come)."""
    where = roots(env, home)
    rows = _RowCache(cache)

    def make(path: Path, kind: str, name: str, source: str) -> FoundModel:
        reader = _gguf_row if kind == "gguf" else _folder_row
        target = path if kind == "gguf" else path / "config.json"
        try:
            return rows.row(target, lambda: reader(path, name, source), name, source)
        except Exception as e:  # one entry that cannot be read is a row with its reason; the scan goes on
            return _skipped(path, name, source, f"it cannot be read ({type(e).__name__}: {e})")

    try:
        for root in where["hf-cache"]:
            for path, kind, name in _hf_cache(root):
                yield make(path, kind, name, "hf-cache")
        for root in where["lm-studio"]:
            for path, kind in _candidates_in(root):
                yield make(path, kind, str(path.relative_to(root)), "lm-studio")
        for root in where["ollama"]:
            for item in _ollama(root):
                yield item if isinstance(item, FoundModel) else make(*item, "ollama")
        for folder in folders:
            folder = Path(folder).expanduser()
            for path, kind in _candidates_in(folder):
                yield make(path, kind, path.name, "folder")
    finally:
        rows.save()


def default_cache() -> Path:
    """Where the row cache lives: the user cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvchat" / "models.json"
