"""The style sheet and icon the app ships (in resources/)."""

from pathlib import Path

RESOURCES = Path(__file__).resolve().parent.parent / "resources"
STYLE = (RESOURCES / "styles" / "kvchat.qss").read_text(encoding="utf-8")


def icon_path() -> Path:
    return RESOURCES / "icons" / "kvchat.svg"
