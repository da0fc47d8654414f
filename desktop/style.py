"""The style sheets and icon the app ships (engine.weights.bundled finds them in a checkout and in a wheel), and
the theme in use: dark or light, by default the operating system's colour scheme."""

from __future__ import annotations

from pathlib import Path

from engine.weights.bundled import resource

THEMES = ("system", "dark", "light")  # what a person picks; "system" follows the OS
SHEETS = {"dark": "kvchat.qss", "light": "kvchat-light.qss"}
LINK_COLORS = {"dark": "#8fb4e0", "light": "#1f5fa8"}  # links in rich text: a style sheet cannot set it
CODE_STYLES = {"dark": "monokai", "light": "default"}  # Pygments' styles for code blocks
_current = {"theme": "dark"}


def style_sheet(theme: str = "dark") -> str:
    """The theme's sheet, its images (the spin boxes' arrows) named by where the styles folder is."""
    sheet = resource("styles", SHEETS[theme]).read_text(encoding="utf-8")
    return sheet.replace("@STYLES@", resource("styles").as_posix())


def resolve(choice: str) -> str:
    """dark or light: the choice itself, or for "system" the OS's colour scheme (dark when it says none)."""
    if choice in SHEETS:
        return choice
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication

    scheme = QGuiApplication.styleHints().colorScheme()
    return "light" if scheme == Qt.ColorScheme.Light else "dark"


def apply_style(app, choice: str = "system") -> str:
    """The style sheet of the theme `choice` resolves to, and the palette colours a style sheet cannot
    reach (links in replies); returns the theme applied."""
    from PySide6.QtGui import QColor, QPalette

    theme = resolve(choice)
    app.setStyleSheet(style_sheet(theme))
    pal = app.palette()
    pal.setColor(QPalette.Link, QColor(LINK_COLORS[theme]))
    app.setPalette(pal)
    _current["theme"] = theme
    return theme


def current_theme() -> str:
    return _current["theme"]


def code_style() -> str:
    return CODE_STYLES[_current["theme"]]


def icon_path() -> Path:
    return resource("icons", "kvchat.svg")


def button(text: str, name: str, slot, layout):
    """A push button with its object name (what tests and the style sheet find it by), wired and placed."""
    from PySide6.QtWidgets import QPushButton

    b = QPushButton(text)
    b.setObjectName(name)
    b.clicked.connect(slot)
    layout.addWidget(b)
    return b
