"""The house rules, checked on the sources (every import, function-level ones included) and on a real
import: engine/ never imports Qt or desktop/; no import cycles among engine/ and desktop/ modules;
the product never imports the tools; the model, the quantization codes and the chat controller stand
alone."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QT = ("PySide6", "PyQt5", "PyQt6", "qasync", "shiboken6")
TOOLS = ("engine.tools", "desktop.tools")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node, parents) -> bool:
    """Inside `if TYPE_CHECKING:` (annotations only: never executed)."""
    for p in parents:
        if isinstance(p, ast.If) and "TYPE_CHECKING" in ast.unparse(p.test):
            return True
    return False


def imports_of(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """Every module `name` imports, at any depth in its code (functions included), resolved to the most
    specific known module: `from engine import trace` is engine.trace, `from .x import f` is pkg.x."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()

    def visit(node, parents):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not _type_checking_only(node, parents):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.add(sub if sub in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child, parents + [node])

    visit(tree, [])
    return out


def graph() -> dict[str, set[str]]:
    """Module -> the engine/desktop modules it imports."""
    files = {module_name(p): p for top in ("engine", "desktop") for p in (ROOT / top).rglob("*.py")}
    known = set(files)
    return {
        name: {
            m
            for m in imports_of(p.read_text(), name, p.name == "__init__.py", known)
            if m.split(".")[0] in ("engine", "desktop")
        }
        | set()
        for name, p in files.items()
    }


def all_imports() -> dict[str, set[str]]:
    files = {module_name(p): p for top in ("engine", "desktop") for p in (ROOT / top).rglob("*.py")}
    return {name: imports_of(p.read_text(), name, p.name == "__init__.py", set(files)) for name, p in files.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, or a module importing itself."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in g.get(v, ()):
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


def is_product(name: str) -> bool:
    """The app and the engine as they run: everything but the tools and the command-line entry points."""
    return not name.startswith(TOOLS) and not name.endswith("__main__")


def test_the_checker_sees_function_level_imports_and_cycles():
    """The rules below are only as good as this: a cycle hidden in a function is found."""
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    src_a = "from . import b\n"
    src_b = "def f():\n    from .c import g\n    return g\n"
    src_c = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import x\ndef g():\n    import pkg.a\n"
    g = {
        "pkg.a": imports_of(src_a, "pkg.a", False, known),
        "pkg.b": imports_of(src_b, "pkg.b", False, known),
        "pkg.c": imports_of(src_c, "pkg.c", False, known),
    }
    assert g == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"typing", "pkg.a"}}
    assert cycles(g) == [["pkg.a", "pkg.b", "pkg.c"]]
    g["pkg.c"].discard("pkg.a")
    assert cycles(g) == []


def test_no_import_cycles_among_engine_and_desktop_modules():
    assert cycles(graph()) == []


def test_engine_sources_import_no_qt_or_desktop():
    bad = [
        f"{m}: {i}"
        for m, imps in all_imports().items()
        if m.startswith("engine")
        for i in imps
        if i.split(".")[0] in (*QT, "desktop")
    ]
    assert bad == []


def test_the_product_never_imports_the_tools():
    bad = [f"{m}: {i}" for m, imps in graph().items() if is_product(m) for i in imps if i.startswith(TOOLS)]
    assert bad == []
    assert any(i.startswith("engine.tools") for i in graph()["engine.__main__"])  # the checker sees such imports


def test_the_model_and_the_quantization_codes_stand_alone():
    g = graph()
    # the architecture: its MLPs, rotations, latent attention and the parts the attention kinds share
    assert g["engine.model"] == {
        "engine.feedforward",
        "engine.rotary",
        "engine.latent_attention",
        "engine.block_parts",
        "engine.short_conv",
        "engine.mamba_mixer",
        "engine.delta_net",
    }
    assert g["engine.latent_attention"] == {"engine.block_parts", "engine.rotary"}
    assert g["engine.block_parts"] == set()
    assert g["engine.short_conv"] == set()
    assert g["engine.mamba_mixer"] == {"engine.block_parts"}  # (the scanning layers' shared part)
    assert g["engine.delta_net"] == {"engine.block_parts"}
    assert g["engine.feedforward"] == set()
    assert g["engine.rotary"] == set()
    assert g["engine.quant"] == set()  # the codes' definition: nothing from the engine


# desktop/core is the app's Qt-free floor (napari's components/ beside its _qt/): the controller and the models.
QT_FREE = tuple(sorted(module_name(p) for p in (ROOT / "desktop" / "core").glob("*.py")))


def test_the_chat_controller_and_the_desktops_models_are_qt_free():
    """Nothing the Qt-free rooms reach, directly or through other modules, imports Qt: a test drives the
    controller with a fake client and no window, and the panel's words are plain functions."""
    g, imps = graph(), all_imports()
    assert {"desktop.core.chat", "desktop.core.replies", "desktop.core.panel_words", "desktop.core.markdown"} <= set(
        QT_FREE
    )
    for name in QT_FREE:
        reach, todo = set(), [name]
        while todo:
            m = todo.pop()
            if m not in reach:
                reach.add(m)
                todo += g.get(m, ())
        assert not [f"{m}: {i}" for m in reach for i in imps.get(m, ()) if i.split(".")[0] in QT], name


def test_the_desktops_core_floor_imports_no_widget():
    """desktop/core imports the engine and itself, never a desktop module above it (the widgets, the seam)."""
    g = graph()
    up = [f"{m}: {i}" for m in QT_FREE for i in g[m] if i.startswith("desktop.") and not i.startswith("desktop.core")]
    assert up == []
    assert any(i.startswith("desktop.core") for i in g["desktop.window"])  # the checker sees the desktop's imports


def test_importing_engine_loads_no_qt():
    code = (
        "import sys, engine, engine.session, engine.cli, engine.spec, engine.weights.loading, desktop.core.chat;"
        "print([m for m in sys.modules if m.split('.')[0] in ('PySide6','qasync','shiboken6')]);"
        "print([m for m in sys.modules if m.startswith(('engine.tools', 'desktop.tools'))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split() == ["[]", "[]"]


# The engine's floors, lowest first: a module imports only modules on its own floor or below, so the model-file
# side never reaches the generation loop or HTTP, the backends never reach the model files, and so on.
FLOORS = [
    (
        "core",
        (
            "engine.errors", "engine.events", "engine.quant", "engine.model", "engine.feedforward",
            "engine.sampling", "engine.trace",
            "engine.config", "engine.devices", "engine.kv_cache", "engine.kv_pool", "engine.passes", "engine.tokenizer",
            "engine.prefix_store", "engine.huge_pages",
            "engine.user_cache", "engine.logprobs", "engine.disk_store", "engine.disk_files", "engine.request",
            "engine.kv_tiers", "engine.grammar", "engine.tool_calls", "engine.images", "engine.vision",
            "engine.image_prompt", "engine.vision_qwen", "engine.text_configs", "engine.rotary", "engine.family_fields",
            "engine.harmony", "engine.text_stream", "engine.latent_attention", "engine.block_parts",
            "engine.short_conv", "engine.mamba_mixer", "engine.delta_net", "engine.state_cache", "engine.rope_config",
        ),
    ),
    ("backends", ("engine.backends",)),
    ("weights", ("engine.weights", "engine.hub", "engine.hub_transfer")),
    ("runtime", ("engine.generation", "engine.drafters", "engine.speculative", "engine.session", "engine.compare",
                 "engine.spec",
                 "engine.batching", "engine.scheduler")),
    ("http", ("engine.http",)),
    ("entry points", ("engine", "engine.cli", "engine.request_options", "engine.__main__")),
]  # fmt: skip


def floor_of(name: str) -> int | None:
    """The floor a module is on (the most specific prefix that names it), None for the tools and desktop."""
    best = None
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if name == p or (name.startswith(p + ".") and p != "engine"):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    return None if best is None else best[0]


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import in `g` from an engine module to a module on a higher floor."""
    engine = [m for m in g if m.startswith("engine") and not m.startswith("engine.tools")]
    return [
        f"{m} ({FLOORS[floor_of(m)][0]}) imports {d} ({FLOORS[floor_of(d)][0]})"
        for m in engine
        for d in g[m]
        if floor_of(d) is not None and floor_of(m) is not None and floor_of(d) > floor_of(m)
    ]


def test_every_engine_module_is_on_a_floor_and_imports_only_downward():
    g = graph()
    engine = [m for m in g if m.startswith("engine") and not m.startswith("engine.tools")]
    assert [m for m in engine if floor_of(m) is None] == []
    assert upward(g) == []


def test_the_floor_rule_refuses_a_synthetic_upward_import():
    """The rule above on a graph with one import planted upward (the model-file side reaching the scheduler, the
    kv tiers reaching the HTTP server): each is found, and nothing else."""
    g = {m: set(d) for m, d in graph().items()}
    g["engine.weights.loading"].add("engine.scheduler")
    g["engine.kv_tiers"].add("engine.http.server")
    assert sorted(upward(g)) == [
        "engine.kv_tiers (core) imports engine.http.server (http)",
        "engine.weights.loading (weights) imports engine.scheduler (runtime)",
    ]


def test_the_floor_rule_sees_an_import_upward():
    assert floor_of("engine.weights.loading") == 2 and floor_of("engine.http.server") == 4
    assert floor_of("engine.session") == 3 and floor_of("engine") == 5 and floor_of("engine.tools.bench") is None
    assert floor_of("engine.weights.loading") < floor_of("engine.session")  # weights importing session: refused
