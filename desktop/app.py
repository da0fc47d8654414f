"""`kvchat` / `python -m desktop`: start the window on the qasync loop (asyncio and Qt share one loop)."""

from __future__ import annotations

import asyncio
import sys


def main(argv=None) -> int:
    from PySide6.QtGui import QIcon
    from PySide6.QtWidgets import QApplication
    import qasync

    from .settings import data_dir
    from .style import STYLE, icon_path
    from .window import MainWindow

    app = QApplication.instance() or QApplication(sys.argv if argv is None else argv)
    app.setApplicationName("kvchat")
    app.setStyleSheet(STYLE)
    app.setWindowIcon(QIcon(str(icon_path())))
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    closed = asyncio.Event()
    app.aboutToQuit.connect(closed.set)
    window = MainWindow(data_dir())
    window.show()
    with loop:
        loop.run_until_complete(closed.wait())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
