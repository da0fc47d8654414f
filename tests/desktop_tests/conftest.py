import asyncio
import os
import time

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


@pytest.fixture(scope="session")
def _session_loop(qapp):
    """One qasync loop for the whole run, as the app has one for its life. A loop per test left closed
    loops (QObjects with live timers) to Python's garbage collector, which may run on an engine worker
    thread: a QObject destroyed there cannot stop its timers, and a later timer event on the GUI thread
    then hits freed memory (a segfault inside QTimerInfoList::activateTimers)."""
    import qasync

    qapp.setQuitOnLastWindowClosed(False)  # tests close every window they open; the run's loop must not quit
    lp = qasync.QEventLoop(qapp, already_running=False)
    yield lp
    lp.close()


@pytest.fixture
def loop(_session_loop):
    asyncio.set_event_loop(_session_loop)
    yield _session_loop
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
    from desktop.core.settings import Settings
    from desktop.settings_dialog import open_settings
    from desktop.window import MainWindow
    from engine.spec import LoadSpec

    made = []

    def make(model_dir=None, data=None, **settings):
        data = data or tmp_path / "data"
        monkeypatch.setenv("KVCHAT_DATA_DIR", str(data))
        spec = {k: settings.pop(k) for k in list(settings) if k in LoadSpec.__dataclass_fields__}
        s = Settings(model=LoadSpec(path=str(model_dir) if model_dir else None, **spec), **settings)
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
