"""Models laid out as the tools people use keep them, in a temporary HOME: the Hugging Face hub cache
(snapshot files symlinked into blobs/), LM Studio (publisher/repo/file.gguf), Ollama (a manifest
naming a GGUF blob by digest) and a plain folder, plus one model kvchat cannot open."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from checkpoints import make_checkpoint
from engine.tools.gguf_export import write_gguf

NAMES = {  # what engine.weights.catalog names each model build() lays out
    "kvchat/tiny-llama",
    "kvchat/tiny-qwen2-GGUF/tiny-qwen2.Q8_0.gguf",
    "kvchat/tiny-llama-GGUF/tiny-llama.Q4_0.gguf",
    "tiny-qwen2:q8_0",
    "tiny-qwen2",
    "tiny-gemma",
}


def _blob(blobs: Path, src: Path) -> Path:
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    dst = blobs / digest
    if not dst.exists():
        shutil.copyfile(src, dst)
    return dst


def build(home: Path, work: Path) -> dict[str, Path]:
    """Four sources under `home`, from tiny checkpoints written in `work`; returns where each model is."""
    llama = make_checkpoint(work / "llama", "llama")
    qwen = make_checkpoint(work / "qwen2", "qwen2")
    q8 = write_gguf(qwen, work / "tiny-qwen2.Q8_0.gguf", matrices="Q8_0", tokenizer=True)
    q4 = write_gguf(llama, work / "tiny-llama.Q4_0.gguf", matrices="Q4_0", tokenizer=True)
    where = {}

    hub = home / ".cache" / "huggingface" / "hub"
    repo = hub / "models--kvchat--tiny-llama"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for f in llama.iterdir():
        (snap / f.name).symlink_to(Path("../../blobs") / _blob(repo / "blobs", f).name)
    where["hf"] = snap
    grepo = hub / "models--kvchat--tiny-qwen2-GGUF"
    gsnap = grepo / "snapshots" / "feedbeef"
    gsnap.mkdir(parents=True)
    (grepo / "blobs").mkdir()
    (gsnap / q8.name).symlink_to(Path("../../blobs") / _blob(grepo / "blobs", q8).name)
    where["hf-gguf"] = gsnap / q8.name

    lms = home / ".lmstudio" / "models" / "kvchat" / "tiny-llama-GGUF"
    lms.mkdir(parents=True)
    shutil.copyfile(q4, lms / q4.name)
    where["lm-studio"] = lms / q4.name

    ollama = home / ".ollama" / "models"
    (ollama / "blobs").mkdir(parents=True)
    digest = hashlib.sha256(q8.read_bytes()).hexdigest()
    shutil.copyfile(q8, ollama / "blobs" / f"sha256-{digest}")
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "tiny-qwen2" / "q8_0"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(
        json.dumps(
            {
                "schemaVersion": 2,
                "layers": [
                    {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"},
                    {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00"},
                ],
            }
        )
    )
    where["ollama"] = ollama / "blobs" / f"sha256-{digest}"

    mine = home / "models"
    shutil.copytree(qwen, mine / "tiny-qwen2")
    where["folder"] = mine / "tiny-qwen2"
    odd = mine / "tiny-gemma"
    shutil.copytree(qwen, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["architectures"] = ["GemmaForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    where["unsupported"] = odd
    return where
