"""Where the data kvchat ships lives (the demo model, style sheet, icon): the `kvchat_resources`
package when installed (a wheel, or `pip install -e .`), else the checkout's resources/ folder."""

from __future__ import annotations

import importlib.resources
from pathlib import Path


def resources_dir() -> Path:
    """The folder holding the bundled data, as a real directory on disk."""
    try:
        root = importlib.resources.files("kvchat_resources")
    except ModuleNotFoundError:  # run from a checkout that was not installed
        return Path(__file__).resolve().parent.parent / "resources"
    return Path(str(root))


def resource(*parts: str) -> Path:
    """A bundled file or folder, e.g. resource("styles", "kvchat.qss")."""
    return resources_dir().joinpath(*parts)


DEMO_MODEL = resource("models", "kvchat-demo")
