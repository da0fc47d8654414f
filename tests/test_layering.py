"""engine/ never imports Qt or desktop/: checked on the source and on a real import."""

import ast
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "engine"


def test_engine_sources_import_no_qt_or_desktop():
    bad = []
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("PySide6", "PyQt5", "PyQt6",
                                                                                 "qasync", "desktop")]
    assert bad == []


def test_importing_engine_loads_no_qt():
    code = ("import sys, engine, engine.session, engine.cli, engine.bench, engine.loader;"
            "print([m for m in sys.modules if m.split('.')[0] in ('PySide6','qasync','desktop')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
