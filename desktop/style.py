"""The style sheet and icon the app ships (engine.bundled finds them in a checkout and in a wheel)."""

from __future__ import annotations

from pathlib import Path

from engine.bundled import resource


def style_sheet() -> str:
    return resource("styles", "kvchat.qss").read_text(encoding="utf-8")


def icon_path() -> Path:
    return resource("icons", "kvchat.svg")
