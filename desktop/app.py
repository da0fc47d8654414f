"""`kvchat` / `python -m desktop`: start the window on the qasync loop (asyncio and Qt share one loop)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys

GIL_SWITCH_S = 0.0005  # how long a thread keeps the GIL while another waits (Python's default: 0.005)


def tune_process(window) -> None:
    """What the app sets for the whole process once its window is up (desktop/README.md, "Long
    conversations"). The GIL changes hands every GIL_SWITCH_S: the worker's Python work (a long
    conversation's chat template) holds it, and the GUI thread's layout and paint call Python many times,
    each waiting up to the switch interval. And what the app holds for good (Qt, torch, the model, the
    conversations read) leaves the cyclic garbage collector's full passes: what exists is frozen now and
    after each model load. A full pass walks every object the process holds, on whichever thread allocates:
    on the GUI thread it stalled switching conversations. Reference counting stays as it is; only cycles
    among frozen objects are no longer collected."""
    sys.setswitchinterval(GIL_SWITCH_S)
    gc.freeze()
    window.modelReady.connect(lambda _facts: gc.freeze())


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="kvchat",
        description="A local chat app that shows inference as it happens.",
        epilog="Conversations, settings and the disk cache live in KVCHAT_DATA_DIR when it is set, else in the "
        "platform's user data folder (on Linux ~/.local/share/kvchat). Qt's own options (-platform, -style, ...) "
        "are passed on to Qt.",
    )
    ap.add_argument(
        "--check", action="store_true", help="start, load the model, print what loaded (or why not) as JSON, and quit"
    )
    ap.add_argument("--model", default=None, help="start on this model folder or GGUF file")
    ns, qt_args = ap.parse_known_args(argv)
    from .platform_libs import uses_xcb, xcb_problem

    problem = xcb_problem() if uses_xcb() and "-platform" not in qt_args else None
    if problem:  # Qt would abort with a line that names only its plugin
        print(problem, file=sys.stderr)
        return 1

    import qasync
    from PySide6.QtGui import QIcon
    from PySide6.QtWidgets import QApplication

    from .core.settings import data_dir
    from .outside_text import warn
    from .single_instance import SingleInstance
    from .style import apply_style, icon_path
    from .window import MainWindow

    app = QApplication.instance() or QApplication(["kvchat", *qt_args])
    app.setApplicationName("kvchat")
    apply_style(app)
    app.setWindowIcon(QIcon(str(icon_path())))
    data = data_dir()
    only = SingleInstance(data)
    if not only.acquire():
        pid = only.holder()
        said = f"kvchat is already open on {data}" + (f" (process {pid})" if pid else "") + ": use that window."
        if ns.check:
            print(json.dumps({"error": said}))
        elif not only.wake_other():
            warn(None, "kvchat", said)
        else:
            print(said, file=sys.stderr)
        return 1
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    closed = asyncio.Event()
    app.aboutToQuit.connect(closed.set)
    window = MainWindow(data, model=ns.model)
    only.listen(window)
    window.show()
    tune_process(window)
    outcome: dict = {}
    if ns.check:

        def checked(facts: dict) -> None:
            outcome.update(facts)
            window.close()
            app.quit()

        window.modelReady.connect(checked)
    with loop:
        loop.run_until_complete(closed.wait())
    code = 0
    only.release()
    if ns.check:
        keys = (
            "error",
            "name",
            "architecture",
            "device",
            "dtype",
            "parameters",
            "capacity",
            "decode_kernels",
            "format",
        )
        print(json.dumps({k: outcome[k] for k in keys if k in outcome}))
        code = 1 if "error" in outcome or not outcome else 0
    if window.worker_left_running:  # inside a load it cannot leave; everything is saved
        sys.stdout.flush()
        os._exit(code)  # Qt would abort on a QThread destroyed while it runs
    return code


if __name__ == "__main__":
    raise SystemExit(main())
