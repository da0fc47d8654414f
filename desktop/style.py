"""The style sheet and icon the app ships (engine.bundled finds them in a checkout and in a wheel)."""

from __future__ import annotations

from pathlib import Path

from engine.bundled import resource

LINK_COLOR = "#8fb4e0"  # links in rich text: a style sheet cannot set it, the palette does


def style_sheet() -> str:
    return resource("styles", "kvchat.qss").read_text(encoding="utf-8")


def apply_style(app) -> None:
    """The style sheet, and the palette colours a style sheet cannot reach (links in replies)."""
    from PySide6.QtGui import QColor, QPalette

    app.setStyleSheet(style_sheet())
    pal = app.palette()
    pal.setColor(QPalette.Link, QColor(LINK_COLOR))
    app.setPalette(pal)


def icon_path() -> Path:
    return resource("icons", "kvchat.svg")
