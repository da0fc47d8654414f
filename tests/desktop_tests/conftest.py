import asyncio
import os
import time

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


@pytest.fixture
def loop(qapp):
    import qasync
    lp = qasync.QEventLoop(qapp, already_running=False)
    asyncio.set_event_loop(lp)
    yield lp
    lp.close() if not lp.is_closed() else None
    asyncio.set_event_loop(None)


def spin(loop, predicate, timeout=60.0):
    """Run the qasync loop (Qt events, signals, asyncio tasks) until predicate() holds."""
    async def wait():
        end = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > end:
                raise TimeoutError("condition not met in time")
            await asyncio.sleep(0.01)
    loop.run_until_complete(wait())


@pytest.fixture
def make_window(qtbot, loop, tmp_path, monkeypatch):
    """A real MainWindow on its own data directory, model loaded."""
    from desktop.settings import Settings, open_settings
    from desktop.window import MainWindow
    made = []

    def make(model_dir=None, data=None, **settings):
        data = data or tmp_path / "data"
        monkeypatch.setenv("KVCHAT_DATA_DIR", str(data))
        s = Settings(model_dir=str(model_dir or ""), **settings)
        s.save(open_settings(data))
        w = MainWindow(data)
        ready = []
        w.modelReady.connect(ready.append)  # the load was queued in __init__; its signal comes later
        qtbot.addWidget(w)
        w.show()
        made.append(w)
        spin(loop, lambda: ready, 120)
        return w
    yield make
    for w in made:
        if not w._closing:
            w.close()


@pytest.fixture
def spin_loop(loop):
    return lambda pred, timeout=60.0: spin(loop, pred, timeout)
