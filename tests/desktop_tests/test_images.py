"""Images in the real window, on a tiny random Gemma 3 that sees them: one pasted and one dropped onto the message
box, sent; their thumbnails in the transcript; their positions a band of their own on the context map, named; a
second question reusing them; the JSON export and import carrying them, the Markdown export linking the files
written beside it; and what is refused — a file that is not an image, images for a model without a vision tower —
with the draft kept and nothing stored."""

import json

import pytest
from gui import send
from PySide6.QtCore import QMimeData, Qt, QUrl
from PySide6.QtGui import QGuiApplication, QImage
from vision_checkpoints import make_vision_checkpoint, picture

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def seeing_model(tmp_path_factory):
    return make_vision_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3")


def paste_image(qtbot, w, data: bytes) -> None:
    """Put a picture on the clipboard and paste it into the message box with Ctrl+V, as a person does."""
    mime = QMimeData()
    mime.setImageData(QImage.fromData(data))
    QGuiApplication.clipboard().setMimeData(mime)
    w.composer.setFocus()
    qtbot.keyClick(w.composer, Qt.Key_V, Qt.ControlModifier)


def drop_files(w, *paths) -> None:
    """Image files dropped onto the message box (a drop lands in insertFromMimeData, as a paste does)."""
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    w.composer.insertFromMimeData(mime)


def attach_two_and_send(qtbot, w, spin_loop, tmp_path, text="What is in these pictures?"):
    paste_image(qtbot, w, picture(40, 30, 0))
    dropped = tmp_path / "dropped.jpg"
    dropped.write_bytes(picture(30, 50, 1, "JPEG"))
    drop_files(w, dropped)
    assert len(w.attachments.images) == 2 and w.attachments.isVisible()
    assert w.composer.toPlainText() == ""  # nothing of the picture typed as text
    return send(qtbot, w, spin_loop, text)


def test_attached_images_are_sent_shown_and_a_band_of_their_own_on_the_map(qtbot, make_window, spin_loop,
                                                                           seeing_model, tmp_path):  # fmt: skip
    from engine.images import image_runs

    w = make_window(seeing_model, dtype="float32", max_new_tokens=6)
    done = attach_two_and_send(qtbot, w, spin_loop, tmp_path)
    assert done.trace["images"]["images"] == 2 and not w.attachments.isVisible()  # sent: the strip is empty again
    user = w.transcript.views[0]
    assert user.imagesRow is not None
    chips = [c for c in user.imagesRow.children() if c.objectName() == "imageChip"]
    assert len(chips) == 2 and "pasted image.png (40×30 PNG)" in chips[0].toolTip()
    assert not chips[0].picture.pixmap().isNull()  # the thumbnail drawn
    # the map: the images' positions are their band, and a position among them names its image
    runs = image_runs(w.chat.cache_map.ids)
    assert len(runs) == 2 and all(b - a == 4 for a, b, _ in runs)
    bands = [(a, b) for a, b, role in w.chat.cache_map.roles() if role == "image"]
    assert bands == [(a, b) for a, b, _ in runs]
    words = w.chat.cache_map.describe(runs[1][0], runs[1][0] + 1)
    assert "Image 2: dropped.jpg (30×50 JPEG" in words and "1 of its 4 positions here" in words
    # a second question about them: their positions come from the cache
    again = send(qtbot, w, spin_loop, "And the colours?")
    assert again.reuse.reused >= runs[-1][1] and again.trace["images"]["encoded"] == 0


def test_export_and_import_carry_the_images(qtbot, make_window, spin_loop, seeing_model, tmp_path):
    from desktop.export_import import export_conversation, import_conversation

    w = make_window(seeing_model, dtype="float32", max_new_tokens=4)
    attach_two_and_send(qtbot, w, spin_loop, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    export_conversation(w, str(out / "pictures.json"))
    data = json.loads((out / "pictures.json").read_text())
    assert len(data["images"]) == 2  # embedded, by hash
    export_conversation(w, str(out / "pictures.md"))
    md = (out / "pictures.md").read_text()
    files = sorted(p.name for p in (out / "pictures-images").iterdir())
    assert len(files) == 2 and all(f"](pictures-images/{f})" in md for f in files)
    # into another data folder: the images come with the conversation
    w2 = make_window(seeing_model, data=tmp_path / "other", dtype="float32", max_new_tokens=4)
    import_conversation(w2, str(out / "pictures.json"))
    spin_loop(lambda: w2.chat.current_cid is not None and w2.transcript.views, 60)
    user = w2.transcript.views[0]
    assert user.imagesRow is not None and len(user.message.trace["images"]) == 2
    assert sorted(p.name for p in (tmp_path / "other" / "images").iterdir()) == files
    # and the imported conversation runs: its images read back from the new folder
    again = send(qtbot, w2, spin_loop, "Once more?")
    assert again.trace["images"]["images"] == 2


def test_what_is_not_an_image_and_a_model_that_does_not_see_them_are_refused(qtbot, make_window, spin_loop,
                                                                             tmp_path):  # fmt: skip
    w = make_window(None, max_new_tokens=4)  # the demo model: text only
    fake = tmp_path / "fake.png"
    fake.write_bytes(b"this is not a picture")
    drop_files(w, fake)
    assert not w.attachments.images and "fake.png is not an image" in w.banner.text()
    real = tmp_path / "real.png"
    real.write_bytes(picture(20, 20, 3))
    drop_files(w, real)
    assert len(w.attachments.images) == 1
    qtbot.keyClicks(w.composer, "What is this?")
    spin_loop(lambda: (w.seen or {}).get("next_error"), 60)  # the meter's probe found the images refused
    assert w.contextMeter.text() == "Next Send: this model does not see images: Send will be refused"
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: "does not see images" in w.banner.text(), 30)
    assert "Qwen2.5-VL). Your message is still in the box." in w.banner.text()
    assert w.composer.toPlainText() == "What is this?" and len(w.attachments.images) == 1  # the draft kept
    assert w.chat.current_cid is None or not w.store.branch(w.chat.current_cid)  # nothing stored
