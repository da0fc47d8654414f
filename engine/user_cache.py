"""Where kvchat keeps what it can rebuild (compiled kernels, tokenizers built from model files): the platform's
user cache directory, or KVCHAT_CACHE_DIR when set (the tests point it at a temporary folder)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(area: str) -> Path:
    """The folder for one kind of cached thing ("kernels", "tokenizers"); not created here."""
    env = os.environ.get("KVCHAT_CACHE_DIR")
    if env:
        return Path(env).expanduser() / area
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvchat", appauthor=False)) / area
