"""Images in the engine: each family that sees them (Gemma 3, Idefics3 / SmolVLM) equal to transformers with its
own image processor, for a prompt with one and with two images; a second question about the same image reusing
its positions; an edit of the text after an image keeping them; the bad inputs, each a clear error."""

import dataclasses
import io
import os
import time

import pytest
import torch
from vision_checkpoints import make_vision_checkpoint, picture

from engine.events import Failed, Finished, PrefillStarted
from engine.image_prompt import PromptImages
from engine.images import ImageError, image_file, image_runs, read_image
from engine.session import Request, Session
from engine.weights.loading import load_model

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module", params=["gemma3", "idefics3", "qwen2_5_vl"])
def seeing(request, tmp_path_factory):
    family = request.param
    path = make_vision_checkpoint(tmp_path_factory.mktemp(family), family)
    return family, path, load_model(path, device="cpu", dtype="float32")


IMAGES = [read_image(picture(40, 30, 0), "a.png"), read_image(picture(30, 50, 1, "JPEG"), "b.jpg")]


def ask(n: int, text: str = "Describe the picture.") -> list[dict]:
    return [{"role": "user", "content": text, "images": tuple(IMAGES[:n])}]


def reference_inputs(family, path, loaded, ids, images):
    """transformers' inputs for our prompt: the image token at each image position, the family's own image
    processor's pixels (its PIL form: the torchvision one needs a CUDA-matched build)."""
    token = loaded.tokenizer.tok.token_to_id(loaded.tokenizer.images.image_token)
    ref_ids = torch.tensor([[token if t < 0 else t for t in ids]])
    pictures = [PIL.open(io.BytesIO(im.data)) for im in images]
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        out = Qwen2VLImageProcessorPil.from_pretrained(path)(pictures, return_tensors="pt")
        return ref_ids, dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                             mm_token_type_ids=(ref_ids == token).int())  # fmt: skip
    if family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        pixels = Gemma3ImageProcessorPil.from_pretrained(path)(pictures, return_tensors="pt")["pixel_values"]
        return ref_ids, dict(pixel_values=pixels, token_type_ids=(ref_ids == token).long())
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    out = Idefics3ImageProcessorPil.from_pretrained(path)([pictures], return_tensors="pt")
    return ref_ids, dict(pixel_values=out["pixel_values"], pixel_attention_mask=out["pixel_attention_mask"])


@pytest.mark.parametrize("n", [1, 2])
def test_logits_equal_transformers_with_one_and_two_images(seeing, n):
    family, path, loaded = seeing
    chat = loaded.tokenizer.chat_prompt(ask(n))
    ids = chat.ids
    runs = image_runs(ids)
    per_image = loaded.tokenizer.images.positions
    assert [b - a for a, b, _ in runs] == (
        [per_image(im) for im in IMAGES[:n]]
        if family != "idefics3"
        else [4] * sum(loaded.tokenizer.images.layout(im).tiles for im in IMAGES[:n])
    )  # Idefics3: a run per tile, between its row and column markers
    assert runs[-1][1] <= chat.spans[-1][0] < chat.spans[-1][1]  # the images come before the message's text
    rows = PromptImages(loaded.vision, loaded.tokenizer.images, chat.images, ids).rows(ids, 0)
    with torch.inference_mode():
        got = loaded.model(torch.tensor([[max(t, 0) for t in ids]]), None, images=rows)[0]  # [T, V]
    ref_ids, extra = reference_inputs(family, path, loaded, ids, IMAGES[:n])
    ref = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(input_ids=ref_ids, **extra).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if family == "gemma3":  # the image's positions see each other whole: causal alone gives other logits
        causal = dataclasses.replace(rows, blocks=())
        with torch.inference_mode():
            other = loaded.model(torch.tensor([[max(t, 0) for t in ids]]), None, images=causal)[0]
        assert (other - want).abs().max() > 1e-3


def generate(session, messages, **kw):
    events = list(session.generate(Request(messages=messages, max_new_tokens=8, ignore_eos=True, **kw)))
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1], next(e for e in events if isinstance(e, PrefillStarted))


def reference_greedy(ref, ref_ids, extra, n: int) -> list[int]:
    """transformers' greedy tokens, decoded on its own cache: the prompt with its images, then each token as text."""
    out = []
    with torch.no_grad():
        step = ref(input_ids=ref_ids, **extra, use_cache=True)
        for _ in range(n):
            out.append(int(step.logits[0, -1].argmax()))
            step = ref(input_ids=torch.tensor([[out[-1]]]), cache=step.cache, use_cache=True)
    return out


@pytest.mark.parametrize("capacity", [512, 4096])
def test_a_chunked_prefill_replies_as_transformers(seeing, capacity):
    """Prefill steps of 5 positions (an image that sees itself whole never cut between two), then cached decode
    steps: the greedy reply equals transformers' on its own cache; at 4,096 positions Gemma 3's sliding layers keep
    a ring (the image's mask over the ring's slots)."""
    family, path, loaded = seeing
    session = Session(loaded, capacity=capacity)
    session.prefill_chunk = 5
    assert session.cache.windowed == (family == "gemma3" and capacity == 4096)
    done, start = generate(session, ask(2), logprobs=True)
    ids = list(start.prompt_token_ids)
    ref_ids, extra = reference_inputs(family, path, loaded, ids, IMAGES[:2])
    ref = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    assert list(done.token_ids) == reference_greedy(ref, ref_ids, extra, 8)
    with torch.no_grad():  # the prompt's last position, after steps of 5: its entropy and top five as transformers'
        last = ref(input_ids=ref_ids, **extra).logits[0, -1].log_softmax(-1)
    first = done.logprobs[0]
    assert first.entropy == pytest.approx(float(-(last.exp() * last).sum()), abs=1e-4)
    assert [a.logprob for a in first.top] == pytest.approx(last.topk(5).values.tolist(), abs=1e-4)
    images = done.trace["images"]
    assert images["images"] == 2
    assert images["positions"] == sum(b - a for a, b, _ in image_runs(ids))
    assert done.trace["ttft_vision_ms"] is not None


def test_a_second_question_about_the_image_reuses_its_positions(seeing):
    _, _, loaded = seeing
    loaded.vision.kept.clear()
    session = Session(loaded, capacity=512)
    first, start = generate(session, ask(1))
    assert first.trace["images"]["encoded"] == 1
    image_end = image_runs(start.prompt_token_ids)[-1][1]
    follow = ask(1) + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And its colours?"}]
    again, start2 = generate(session, follow)
    assert start2.reuse.reused >= image_end  # the image's positions came from the cache
    assert again.trace["images"]["encoded"] == 0  # and the encoder did not run
    fresh_model = load_model(loaded.path, device="cpu", dtype="float32")
    fresh, _ = generate(Session(fresh_model, capacity=512), follow)
    assert again.token_ids == fresh.token_ids


def test_an_edit_after_the_image_keeps_its_positions_and_another_image_does_not(seeing):
    _, _, loaded = seeing
    session = Session(loaded, capacity=512)
    _, start = generate(session, ask(1, "What is in the picture?"))
    image_end = image_runs(start.prompt_token_ids)[-1][1]
    edited, start2 = generate(session, ask(1, "What colour is the block?"))
    assert start2.reuse.reused >= image_end  # the text after the image changed: the image stays
    assert edited.token_ids == generate(Session(loaded, capacity=512), ask(1, "What colour is the block?"))[0].token_ids
    other = [{"role": "user", "content": "What colour is the block?", "images": (IMAGES[1],)}]
    _, start3 = generate(session, other)
    assert start3.reuse.reused <= image_runs(start3.prompt_token_ids)[0][0]  # another image: recomputed from its start


# --- bad input ----------------------------------------------------------------------------------
def test_what_is_not_an_image_is_refused_clearly(tmp_path):
    with pytest.raises(ImageError, match="not an image"):
        read_image(b"GIF89a but not really" * 10, "fake.gif")
    with pytest.raises(ImageError, match="empty"):
        read_image(b"", "empty.png")
    png = picture(8, 8)
    with pytest.raises(ImageError, match="cannot be decoded"):
        read_image(png[: len(png) // 2], "cut.png")


def test_a_pixel_bomb_is_refused_from_its_header(tmp_path):
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    # 60,000 × 60,000 pixels claimed by a file of a few hundred bytes: refused before anything is decoded
    head = chunk(b"IHDR", struct.pack(">IIBBBBB", 60_000, 60_000, 8, 2, 0, 0, 0))
    bomb = b"\x89PNG\r\n\x1a\n" + head + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b"")
    with pytest.raises(ImageError, match="pixels"):
        read_image(bomb, "bomb.png")


def test_a_one_gigabyte_file_is_refused_unread(tmp_path):
    big = tmp_path / "huge.png"
    with open(big, "wb") as f:
        f.truncate(2**30)  # sparse: a gigabyte that takes no disk
    with pytest.raises(ImageError, match="limited to"):
        image_file(big)
    assert os.path.getsize(big) == 2**30


def test_a_model_without_a_vision_tower_says_so_and_keeps_its_cache(tmp_path):
    from checkpoints import make_checkpoint

    loaded = load_model(make_checkpoint(tmp_path / "text"), device="cpu", dtype="float32")
    session = Session(loaded, capacity=256)
    ok, _ = generate(session, [{"role": "user", "content": "Hello there"}])
    held = list(session.ids)
    events = list(session.generate(Request(messages=ask(1), max_new_tokens=4)))
    assert isinstance(events[-1], Failed) and "does not see images" in events[-1].error
    assert session.ids == held  # nothing computed, nothing lost


# --- the command line ---------------------------------------------------------------------------
def cli(*args, stdin=None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "engine", *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


def test_generate_with_images_on_the_command_line(seeing, tmp_path):
    import json

    family, path, _ = seeing
    a, b = tmp_path / "a.png", tmp_path / "b.jpg"
    a.write_bytes(IMAGES[0].data)
    b.write_bytes(IMAGES[1].data)
    r = cli("generate", "--model", path, "--dtype", "float32", "--image", a, "--image", b, "--prompt", "Describe it.",
            "--max-new-tokens", 4, "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["trace"]["images"]["images"] == 2 and out["trace"]["images"]["encoded"] == 2
    assert len(image_runs(out["prompt_token_ids"])) >= 2
    r = cli("generate", "--model", path, "--image", a, "--prompt", "Hi", "--max-new-tokens", 2)
    assert r.returncode == 0 and "images 1 · encoder" in r.stderr  # the line after the reply
    fake = tmp_path / "fake.png"
    fake.write_bytes(b"not a picture")
    r = cli("generate", "--model", path, "--image", fake, "--prompt", "Hi")
    assert r.returncode == 2 and "fake.png is not an image" in r.stderr and "loading" not in r.stderr


def test_chat_takes_an_image_and_an_edit_keeps_it(seeing, tmp_path):
    _, path, _ = seeing
    a = tmp_path / "a.png"
    a.write_bytes(IMAGES[0].data)
    r = cli("chat", "--model", path, "--max-new-tokens", "3", "--image", a,
            stdin="What is this?\n/edit 1 What colour is it?\n/quit\n")  # fmt: skip
    assert r.returncode == 0, r.stderr
    reuse = [line for line in r.stdout.splitlines() if "· reused" in line]
    assert len(reuse) == 2
    kept = int(reuse[1].split("reused ")[1].split()[0])
    assert kept > loaded_positions(path, a)  # the edit kept the image's positions


def loaded_positions(path, image_path) -> int:
    loaded = load_model(path, device="cpu", dtype="float32")
    ids = loaded.tokenizer.chat_prompt([{"role": "user", "content": "x", "images": (image_file(image_path),)}]).ids
    return image_runs(ids)[-1][1] - 1


# --- the server and a remote engine ---------------------------------------------------------------
def test_the_server_takes_image_url_parts_and_refuses_bad_ones(seeing, serve):
    import httpx
    from servers import serve_in_thread, stop_thread_server

    family, path, loaded = seeing
    server = serve("--model", str(path), "--dtype", "float32", "--allow-image-urls")
    url = f"{server.url}/chat/completions"

    def content(*images, text="Describe the picture."):
        return [{"type": "image_url", "image_url": {"url": u}} for u in images] + [{"type": "text", "text": text}]

    def ask_server(parts, **kw):
        body = {"model": path.name, "messages": [{"role": "user", "content": parts}], "max_tokens": 6,
                "temperature": 0}  # fmt: skip
        return httpx.post(url, json=body | kw, timeout=120)

    r = ask_server(content(IMAGES[0].data_url(), IMAGES[1].data_url()))
    assert r.status_code == 200, r.text
    got = r.json()
    session = Session(loaded, capacity=4096)
    fin = list(session.generate(Request(messages=ask(2), max_new_tokens=6)))[-1]
    assert got["choices"][0]["message"]["content"] == fin.text
    assert got["kvchat"]["trace"]["images"]["images"] == 2
    again = ask_server(content(IMAGES[0].data_url(), IMAGES[1].data_url(), text="And the colours?")).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= image_runs(fin_prompt(loaded))[-1][1]

    bad = ask_server(content("data:image/png;base64," + "QUJD" * 10))  # base64 of "ABC…": not an image
    assert bad.status_code == 400 and "not an image" in bad.json()["error"]["message"]
    bad = ask_server(content("file:///etc/passwd"))
    assert bad.status_code == 400 and "data: URL" in bad.json()["error"]["message"]

    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    def picture_route(request):
        kind = request.path_params["kind"]
        if kind == "png":
            return Response(IMAGES[0].data, media_type="image/png")
        return Response(b"<html>no</html>", media_type="text/html")

    port, web, thread = serve_in_thread(Starlette(routes=[Route("/{kind}", picture_route)]), "a picture server")
    try:
        fetched = ask_server(content(f"http://127.0.0.1:{port}/png"))
        assert fetched.status_code == 200, fetched.text
        assert fetched.json()["kvchat"]["trace"]["images"]["images"] == 1
        html = ask_server(content(f"http://127.0.0.1:{port}/html"))
        assert html.status_code == 400 and "not an image" in html.json()["error"]["message"]
    finally:
        stop_thread_server(web, thread)
    assert ask_server(content(IMAGES[0].data_url())).status_code == 200  # still serving


def fin_prompt(loaded, n: int = 2) -> list[int]:
    return loaded.tokenizer.chat_prompt(ask(n)).ids


def test_a_server_without_the_flag_refuses_image_urls_and_a_text_model_refuses_images(serve):
    import httpx

    server = serve()  # the demo model: text only
    body = {
        "model": "kvchat-demo",
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                    {"type": "text", "text": "Hi"},
                ],
            }
        ],
    }
    r = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "--allow-image-urls" in r.json()["error"]["message"]
    body["messages"][0]["content"][0]["image_url"]["url"] = IMAGES[0].data_url()
    r = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "does not see images" in r.json()["error"]["message"]


def test_a_remote_engine_is_sent_the_images(seeing, serve):
    from engine.http.remote import RemoteSession, RemoteSpec

    _, path, loaded = seeing
    server = serve("--model", str(path), "--dtype", "float32")
    remote = RemoteSession(RemoteSpec(server.root))
    try:
        remote.connect()
        fin = list(remote.generate(Request(messages=ask(1), max_new_tokens=5)))[-1]
        seen = remote.cached_positions(Request(messages=ask(1), add_generation_prompt=False))  # the app's probe
    finally:
        remote.close()
    assert "error" not in seen and seen["cached"] >= image_runs(fin_prompt(loaded, 1))[-1][1]
    local = list(Session(loaded, capacity=4096).generate(Request(messages=ask(1), max_new_tokens=5)))[-1]
    assert isinstance(fin, Finished), fin
    assert fin.text == local.text


# --- GGUF with llama.cpp's projector file ----------------------------------------------------------
@pytest.mark.parametrize("matrices", ["F32", "F16"])
def test_the_gguf_and_projector_file_equal_the_folder(seeing, tmp_path, matrices):
    """The text model as GGUF and the vision side as llama.cpp's mmproj file (its names from gguf-py's map, its
    metadata as its converter writes it), beside it in one folder: the same logits as the folder (F32 exactly;
    F16 matrices within their rounding)."""
    pytest.importorskip("gguf")
    from engine.tools.gguf_export import write_gguf, write_mmproj

    family, path, loaded = seeing
    write_gguf(path, tmp_path / "model.gguf", tokenizer=True)
    write_mmproj(path, tmp_path / f"mmproj-{family}-{matrices.lower()}.gguf", matrices)
    gguf_form = load_model(tmp_path, device="cpu", dtype="float32")  # the folder: the model and its projector
    assert gguf_form.path.name == "model.gguf" and gguf_form.vision is not None, gguf_form.vision_note
    assert gguf_form.facts()["images"].startswith(family)
    outs = []
    for m in (loaded, gguf_form):
        chat = m.tokenizer.chat_prompt(ask(2))
        rows = PromptImages(m.vision, m.tokenizer.images, chat.images, chat.ids).rows(chat.ids, 0)
        with torch.inference_mode():
            outs.append(m.model(torch.tensor([[max(t, 0) for t in chat.ids]]), None, images=rows)[0])
    assert outs[0].shape == outs[1].shape
    torch.testing.assert_close(outs[1], outs[0], atol=0 if matrices == "F32" else 0.05, rtol=0)
    alone = tmp_path / "alone"  # the same model file without its projector: another fingerprint (its images' K/V)
    alone.mkdir()
    (alone / "model.gguf").write_bytes((tmp_path / "model.gguf").read_bytes())
    assert load_model(alone, device="cpu", dtype="float32").fingerprint["weights"] != gguf_form.fingerprint["weights"]


def test_a_projector_file_for_another_model_leaves_the_text_model_running(seeing, tmp_path):
    pytest.importorskip("gguf")
    from engine.tools.gguf_export import write_gguf, write_mmproj

    family, path, _ = seeing
    other = "idefics3" if family == "gemma3" else "gemma3"
    write_gguf(path, tmp_path / "model.gguf", tokenizer=True)
    write_mmproj(make_vision_checkpoint(tmp_path / "other", other), tmp_path / "mmproj-other.gguf")
    m = load_model(tmp_path / "model.gguf", device="cpu", dtype="float32")
    assert m.vision is None and m.facts()["images"].startswith("opened for text only")
    assert "vocabulary lacks" in m.vision_note
    events = list(Session(m, capacity=256).generate(Request(messages=ask(1), max_new_tokens=2)))
    assert isinstance(events[-1], Failed) and "does not see images" in events[-1].error


# --- the Hub and the models on disk ----------------------------------------------------------------
def test_a_pull_brings_the_projector_file_and_the_models_list_says_the_model_sees_images(tmp_path):
    """A GGUF repository with two projector files: the pull downloads the model and its F16 projector beside it
    (the model opens seeing images); the safetensors form comes with its preprocessor_config.json; the list of
    models on disk says both see images and lists no projector file as a model of its own."""
    import json
    import os

    pytest.importorskip("starlette")
    pytest.importorskip("gguf")
    from hub_standin import HubStandIn, Repo

    from engine.tools.gguf_export import write_gguf, write_mmproj

    folder = make_vision_checkpoint(tmp_path / "src", "gemma3")
    model = write_gguf(folder, tmp_path / "model.gguf", tokenizer=True).read_bytes()
    f16 = write_mmproj(folder, tmp_path / "f16.gguf", "F16").read_bytes()
    q8 = write_mmproj(folder, tmp_path / "q8.gguf", "Q8_0").read_bytes()
    files = {n: p.read_bytes() for n, p in ((p.name, p) for p in folder.iterdir()) if p.is_file()}
    repos = {
        "kvchat/vision-GGUF": Repo(
            {"vision-F32.gguf": model, "mmproj-vision-F16.gguf": f16, "mmproj-vision-Q8_0.gguf": q8}
        ),  # fmt: skip
        "kvchat/vision": Repo(files, tags=("safetensors",)),
    }
    server = HubStandIn(repos)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=server.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hub"),
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1")  # fmt: skip
    try:
        import subprocess
        import sys

        def engine(*args):
            return subprocess.run([sys.executable, "-m", "engine", *map(str, args)], capture_output=True, text=True,
                                  env=env, timeout=300)  # fmt: skip

        r = engine("pull", "kvchat/vision-GGUF", "--json")  # one model file: the projector comes with it
        assert r.returncode == 0, r.stderr
        path = json.loads(r.stdout)["path"]
        assert path.endswith("vision-F32.gguf")
        beside = sorted(os.listdir(os.path.dirname(path)))
        assert beside == ["mmproj-vision-F16.gguf", "vision-F32.gguf"]  # the F16 projector, not the Q8_0 one
        info = json.loads(engine("info", "--model", path, "--json").stdout)
        assert info["images"].startswith("gemma3: SigLIP")
        r = engine("pull", "kvchat/vision", "--json")
        assert r.returncode == 0, r.stderr
        where = json.loads(r.stdout)["path"]
        assert "preprocessor_config.json" in os.listdir(where)
        rows = json.loads(engine("models", "--json", "--no-cache").stdout)
        listed = {row["path"]: row for row in rows}
        assert listed[path]["images"] == "sees images with mmproj-vision-F16.gguf"
        assert listed[where]["images"] == "sees images (gemma3: 4 positions an image)"
        assert not any(os.path.basename(p).startswith("mmproj") for p in listed)
    finally:
        server.stop()


def test_an_images_positions_come_back_from_the_disk_tier_and_reply_as_fresh(seeing, tmp_path):
    """A new session on the same disk tier (as a new process would be): the image's positions read back from
    disk, not encoded again, and the same reply as a fresh run; blocks holding image ids hash apart from text."""
    from engine.disk_store import DiskStore, block_keys

    _, _, loaded = seeing
    first = Session(loaded, capacity=512, disk=DiskStore(tmp_path, 2**30))
    want, start = generate(first, ask(1))
    assert first.flush()
    loaded.vision.kept.clear()  # what a new process would not have
    again, start2 = generate(Session(loaded, capacity=512, disk=DiskStore(tmp_path, 2**30)), ask(1))
    assert start2.reuse.source == "disk" and start2.reuse.reused >= image_runs(start.prompt_token_ids)[-1][1]
    assert again.trace["images"]["encoded"] == 0  # the encoder did not run: its positions were on disk
    assert again.token_ids == want.token_ids
    ids = list(start.prompt_token_ids)[:16]
    text = [max(t, 0) for t in ids]
    assert block_keys(ids) != block_keys(text)


def test_requests_with_images_beside_others_each_equal_their_run_alone(seeing):
    """Four requests at once through the engine's lanes (two images, one image, text alone, another image): each
    one's tokens equal its run alone, their decode steps shared (Qwen2.5-VL's positions after an image run ahead
    of their indices in the batched step too)."""
    import threading

    from engine.scheduler import END, EngineThread

    _, _, loaded = seeing
    asks = [ask(2), ask(1, "What colour?"), [{"role": "user", "content": "Just text, no picture."}],
            [{"role": "user", "content": "And this one?", "images": (IMAGES[1],)}]]  # fmt: skip
    requests = [Request(messages=m, max_new_tokens=80, ignore_eos=True) for m in asks]  # long enough to overlap
    alone = [list(Session(loaded, capacity=512).generate(r))[-1] for r in requests]
    engine = EngineThread(parallel=4)
    engine.session = engine.call(Session, loaded, 512).result()
    events, done = [[] for _ in requests], threading.Semaphore(0)

    def sink_for(i):
        return lambda ev: done.release() if ev is END else events[i].append(ev)

    tickets = [engine.submit(r, sink_for(i)) for i, r in enumerate(requests)]
    for _ in requests:
        assert done.acquire(timeout=120)
    try:
        for i, evs in enumerate(events):
            assert isinstance(evs[-1], Finished), evs[-1]
            assert evs[-1].token_ids == alone[i].token_ids, i
        assert max(max(t.trace.batch_sizes) for t in tickets) > 1  # they decoded side by side
    finally:
        engine.close(10)


def test_a_config_naming_a_huge_tower_is_refused_before_anything_is_allocated(tmp_path):
    """A config.json whose vision tower has 5,000 layers of 8,192 (3 × 10¹² values): the model's shapes are worked
    out on the meta device and checked against the file's headers first, so the text model opens, says why it
    sees no images, and nothing the size of that tower is allocated."""
    import json
    import shutil
    import time

    src = make_vision_checkpoint(tmp_path / "src", "gemma3")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["vision_config"].update(num_hidden_layers=5000, hidden_size=8192, intermediate_size=8192,
                                num_attention_heads=16)  # fmt: skip
    (bad / "config.json").write_text(json.dumps(raw))
    t0 = time.perf_counter()
    m = load_model(bad, device="cpu", dtype="float32")
    assert time.perf_counter() - t0 < 30  # (an allocation of that tower would not return at all)
    assert m.vision is None and m.vision_note.startswith("opened for text only") and "is missing" in m.vision_note


def test_the_encoder_runs_a_layer_a_turn_so_a_stop_and_other_streams_go_on(seeing):
    """A Stop at the first progress of a request with an image ends it after one encoder layer (the image not
    encoded, nothing kept); through the lanes, a text stream's tokens come between the image's encoder layers."""
    import threading

    from engine.scheduler import END, EngineThread

    _, _, loaded = seeing
    loaded.vision.kept.clear()
    cancel = threading.Event()
    events = []
    for ev in Session(loaded, capacity=512).generate(Request(messages=ask(1), max_new_tokens=4), cancel):
        events.append(ev)
        if type(ev).__name__ == "PrefillProgress":
            cancel.set()
    assert isinstance(events[-1], Finished) and events[-1].reason == "cancelled"
    assert not loaded.vision.kept  # stopped inside the encoder: the image was never finished
    order, done = [], threading.Semaphore(0)
    engine = EngineThread(parallel=2)
    engine.session = engine.call(Session, loaded, 512).result()
    text = Request(messages=[{"role": "user", "content": "Tell me a story."}], max_new_tokens=60, ignore_eos=True)
    image = Request(messages=ask(1), max_new_tokens=4, ignore_eos=True)

    def sink(i):
        return lambda ev: done.release() if ev is END else order.append((i, type(ev).__name__))

    try:
        engine.submit(text, sink(0))
        while not any(name == "Token" for _, name in order):  # the text stream runs first
            time.sleep(0.005)
        engine.submit(image, sink(1))
        for _ in range(2):
            assert done.acquire(timeout=120)
    finally:
        engine.close(10)
    layers = [k for k, (i, name) in enumerate(order) if i == 1 and name == "PrefillProgress"]
    assert len(layers) >= loaded.vision.cfg.num_layers  # a progress after each encoder layer
    between = [name for i, name in order[layers[0] : layers[-1]] if i == 0]
    assert "Token" in between  # the text stream went on while the image was being encoded
