"""The Models dialog's Hub tab, against a stand-in of the Hugging Face Hub on loopback: search, a repository's
files with their quantization, size and whether they fit, a download paused and resumed from where it stopped
with its progress shown, then opened; with no Hub at all, a clear message and the local models still listed."""

import os

import pytest
from PySide6.QtCore import Qt

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from hub_standin import COMMIT, HubStandIn, Repo
from servers import free_port

from desktop.core.panel_words import fmt_size
from engine.tools.gguf_export import write_gguf


@pytest.fixture
def hub(tmp_path, demo_model_dir, monkeypatch):
    gguf = write_gguf(demo_model_dir, tmp_path / "demo.gguf", "F32", tokenizer=True).read_bytes()
    llama = {"gguf": {"architecture": "llama", "context_length": 2048}}
    folder = {n: (demo_model_dir / n).read_bytes() for n in ("config.json", "tokenizer.json", "model.safetensors")}
    server = HubStandIn(
        {
            "kvchat/demo-GGUF": Repo({"demo-F32.gguf": gguf, "demo-Q4_K_M.gguf": gguf}, summary=llama),
            "kvchat/demo": Repo(
                folder, tags=("safetensors",), summary={"config": {"architectures": ["LlamaForCausalLM"]}}
            ),
            "kvchat/new-GGUF": Repo({"new-Q4_0.gguf": gguf}, summary={"gguf": {"architecture": "gemma3n"}}),
        },
        trickle=("demo-Q4_K_M.gguf", len(gguf) // 4),
    )
    for k in [k for k in os.environ if k.startswith("HF_")]:
        monkeypatch.delenv(k)
    for k, v in dict(HF_ENDPOINT=server.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hub"),
                     HF_HUB_DISABLE_XET="1").items():  # fmt: skip
        monkeypatch.setenv(k, v)
    yield server, gguf, tmp_path / "hub"
    server.stop()


def test_search_pick_download_pause_resume_and_open(qtbot, make_window, spin_loop, demo_model_dir, hub):
    server, gguf, cache = hub
    w = make_window(demo_model_dir)
    dlg = w.open_models_dialog()
    tab = dlg.hub
    dlg.tabs.setCurrentWidget(tab)
    assert dlg.openButton.isHidden() and dlg.rescanButton.isHidden()  # the other tab's buttons
    qtbot.keyClicks(tab.query, "kvchat")
    with qtbot.waitSignal(tab.searched, timeout=30000):
        qtbot.mouseClick(tab.searchButton, Qt.LeftButton)
    repos = {tab.repos.item(r, 0).text(): r for r in range(tab.repos.rowCount())}
    assert set(repos) == {"kvchat/demo-GGUF", "kvchat/demo", "kvchat/new-GGUF"}
    g = repos["kvchat/demo-GGUF"]
    assert tab.repos.item(g, 1).text() == "gguf" and tab.repos.item(g, 2).text() == "1,000"

    def files_of(repo):
        with qtbot.waitSignal(tab.listed, timeout=30000):
            tab.repos.selectRow(repos[repo])
        return {tab.files.item(r, 0).text(): [tab.files.item(r, c).text() for c in range(6)] for r in
                range(tab.files.rowCount())}  # fmt: skip

    folder = files_of("kvchat/demo")["(the whole model: safetensors folder)"]
    assert folder[3] == fmt_size(2 * 6 * 4 * 32 * 4) and folder[4] == "yes"  # 2·L·H_kv·d·b from its config.json
    new = files_of("kvchat/new-GGUF")["new-Q4_0.gguf"]
    assert new[4] == "no: GGUF architecture 'gemma3n' is not supported yet" and new[3] == "after download"
    files = files_of("kvchat/demo-GGUF")
    assert set(files) == {"demo-F32.gguf", "demo-Q4_K_M.gguf"}
    cells = files["demo-Q4_K_M.gguf"]
    assert cells[1] == "Q4_K_M" and cells[4] == "yes" and cells[5].startswith("fits (")
    row = list(files).index("demo-Q4_K_M.gguf")
    tab.files.selectRow(row)
    assert tab.downloadButton.isEnabled() and not tab.pauseButton.isEnabled()

    qtbot.mouseClick(tab.downloadButton, Qt.LeftButton)
    spin_loop(lambda: 250 <= tab.progress.value() < 1000, 60)  # past a quarter: the stand-in slows down there
    assert "MiB/s" in tab.progress.format() and tab.pauseButton.isEnabled()
    qtbot.mouseClick(tab.pauseButton, Qt.LeftButton)
    spin_loop(lambda: tab.proc is None, 30)
    assert tab.note.text().startswith("Paused: kvchat/demo-GGUF:demo-Q4_K_M.gguf")
    assert tab.downloadButton.text() == "Resume" and tab.cancelButton.isEnabled()
    paused_at = tab.progress.value()
    assert "paused at" in tab.progress.format() and "MiB/s" not in tab.progress.format()  # no rate, no time left
    assert not tab.cancelButton.hasFocus()  # a stray Enter does not discard what came
    assert not list((cache / "models--kvchat--demo-GGUF" / "snapshots").glob("*/*.gguf"))  # nothing half-written

    ready = []
    w.modelReady.connect(ready.append)
    qtbot.mouseClick(tab.downloadButton, Qt.LeftButton)
    assert tab.progress.value() == paused_at and "resuming at" in tab.progress.format()  # not back to 0
    spin_loop(lambda: ready, 120)
    want = cache / "models--kvchat--demo-GGUF" / "snapshots" / COMMIT / "demo-Q4_K_M.gguf"
    assert dlg.chosen == str(want) and open(want, "rb").read() == gguf
    assert w.facts["path"] == str(want) and w.settings.model.path == str(want)
    resumed = server.ranges["demo-Q4_K_M.gguf"][-1]
    assert resumed is not None and int(resumed.split("=")[1].split("-")[0]) >= len(gguf) // 4


def test_without_a_hub_the_tab_says_so_and_the_local_models_stay(qtbot, make_window, demo_model_dir, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    w = make_window(demo_model_dir)
    dlg = w.open_models_dialog()
    with qtbot.waitSignal(dlg.scanned, timeout=60000):
        pass
    tab = dlg.hub
    qtbot.keyClicks(tab.query, "smollm2")
    with qtbot.waitSignal(tab.searched, timeout=30000):
        qtbot.mouseClick(tab.searchButton, Qt.LeftButton)
    assert tab.note.text().startswith(f"cannot reach the Hugging Face Hub at {os.environ['HF_ENDPOINT']}")
    assert "Tick Offline" in tab.note.text()
    assert "still listed in the other tab" in tab.note.text() and tab.repos.rowCount() == 0
    assert dlg.table.item(0, 0).text() == "kvchat-demo"  # the local list is untouched


def test_without_a_network_the_tab_says_so_at_once_and_offline_stops_asking(
    qtbot, make_window, demo_model_dir, monkeypatch
):
    monkeypatch.setenv("HF_ENDPOINT", "https://kvchat-no-such-host.invalid")  # never resolves
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored after the switch below sets it
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)  # a machine with no network, not one behind a proxy
    w = make_window(demo_model_dir)
    tab = w.open_models_dialog().hub
    qtbot.keyClicks(tab.query, "smollm2")
    with qtbot.waitSignal(tab.searched, timeout=10000):  # the resolver alone could wait 24 s here
        qtbot.mouseClick(tab.searchButton, Qt.LeftButton)
    assert tab.note.text().startswith("cannot reach the Hugging Face Hub at https://kvchat-no-such-host.invalid")
    assert "Tick Offline" in tab.note.text() and tab.searchButton.isEnabled()
    tab.offline.setChecked(True)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and not tab.searchButton.isEnabled() and not tab.query.isEnabled()
    assert tab.note.text().startswith("Offline: the Hub is not asked")
    tab.offline.setChecked(False)
    assert "HF_HUB_OFFLINE" not in os.environ and tab.searchButton.isEnabled()


def test_a_repository_of_200000_files_lists_a_page_and_says_the_rest(qtbot, make_window, demo_model_dir, tmp_path,
                                                                      monkeypatch):  # fmt: skip
    """The probe's listing: 200,000 GGUF files. The tab shows the first MAX_ROWS and counts the rest in a note
    of one line; the dialog answers meanwhile (the listing is read on a thread)."""
    from desktop.hub_tab import MAX_ROWS

    many = [{"rfilename": f"shard-{i:06d}-Q4_0.gguf", "size": 1 << 20} for i in range(200_000)]
    server = HubStandIn({"evil/huge-GGUF": Repo({"a.gguf": b"GGUF"}, lies={"siblings": many})})
    try:
        for k in [k for k in os.environ if k.startswith("HF_")]:
            monkeypatch.delenv(k)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        w = make_window(demo_model_dir)
        tab = w.open_models_dialog().hub
        qtbot.keyClicks(tab.query, "huge")
        with qtbot.waitSignal(tab.searched, timeout=30000):
            qtbot.mouseClick(tab.searchButton, Qt.LeftButton)
        with qtbot.waitSignal(tab.listed, timeout=60000):
            tab.repos.selectRow(0)
        assert tab.files.rowCount() == MAX_ROWS
        note = tab.note.text()
        assert "\n" not in note and len(note) < 300 and "more not shown" in note
        assert tab.files.item(1, 0).text() == "shard-000000-Q4_0.gguf" and tab.files.item(1, 1).text() == "Q4_0"
    finally:
        server.stop()
