"""`python -m engine models`: the models on this machine, from all four sources, with their facts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from model_layouts import NAMES, build

from engine.errors import ModelLoadError
from engine.weights.catalog import scan
from engine.weights.loading import load_model


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    return home, build(home, tmp_path_factory.mktemp("work"))


def test_models_lists_every_source_with_its_facts(home):
    home, where = home
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "OLLAMA"))}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
    cmd = [sys.executable, "-m", "engine", "models", "--json", "--folder", str(home / "models")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    assert (listed[0]["name"], listed[0]["source"], listed[0]["openable"]) == ("kvchat-demo", "bundled", True)
    rows = {row["name"]: row for row in listed[1:]}  # the bundled demo model first, as the Models dialog lists it
    assert set(rows) == NAMES
    hf = rows["kvchat/tiny-llama"]
    assert (hf["source"], hf["format"], hf["architecture"], hf["quantization"]) == (
        "hf-cache",
        "safetensors",
        "LlamaForCausalLM",
        "f32",
    )
    from safetensors import safe_open

    with safe_open(str(where["hf"] / "model.safetensors"), framework="pt") as f:
        numel = sum(f.get_tensor(k).numel() for k in f.keys())
    assert hf["openable"] and hf["parameters"] == numel
    assert hf["size_bytes"] == (where["hf"] / "model.safetensors").stat().st_size  # the blob's, through the link
    lms = rows["kvchat/tiny-llama-GGUF/tiny-llama.Q4_0.gguf"]
    assert (lms["source"], lms["format"], lms["architecture"], lms["quantization"]) == (
        "lm-studio",
        "gguf",
        "llama",
        "Q4_0",
    )
    oll = rows["tiny-qwen2:q8_0"]
    assert (oll["source"], oll["format"], oll["architecture"], oll["quantization"], oll["openable"]) == (
        "ollama",
        "gguf",
        "qwen2",
        "Q8_0",
        True,
    )
    assert oll["path"] == str(where["ollama"]) and oll["size_bytes"] == where["ollama"].stat().st_size
    assert rows["tiny-qwen2"]["source"] == "folder" and rows["tiny-qwen2"]["openable"]
    bad = rows["tiny-gemma"]
    assert not bad["openable"] and "unsupported architecture 'GemmaForCausalLM'" in bad["reason"]
    for name, row in rows.items():  # every openable row opens, by the path the list gives
        if row["openable"]:
            assert load_model(row["path"]).config.vocab_size > 0, name
    assert (home / ".cache" / "kvchat" / "models.json").is_file()  # the second scan reads no GGUF again


def test_the_row_cache_is_used_and_follows_changes(home, tmp_path):
    home, where = home
    env = {"HOME": str(home)}
    cache = tmp_path / "models.json"
    first = list(scan([home / "models"], env=env, home=home, cache=cache))
    data = json.loads(cache.read_text())
    assert len(data["rows"]) == len(first)
    again = list(scan([home / "models"], env=env, home=home, cache=cache))
    assert again == first
    empty = tmp_path / "empty"
    empty.mkdir()
    assert list(scan([], env={"HF_HUB_CACHE": str(empty), "OLLAMA_MODELS": str(empty)}, home=empty)) == []


def test_a_bad_entry_is_a_row_with_its_reason_and_the_scan_goes_on(tmp_path_factory, tmp_path):
    """A forged safetensors header (2^62 × 2^62 values in a 100-byte file), an Ollama manifest that is a
    list, one whose layers are numbers, a refs/main that is not text, a tampered row cache: each entry is
    a row that says why (or falls back), and every good model is still found."""
    import struct

    home = tmp_path_factory.mktemp("hostile-home")
    build(home, tmp_path_factory.mktemp("hostile-work"))
    forged = home / "models" / "forged"
    forged.mkdir(parents=True)
    (forged / "config.json").write_text((home / "models" / "tiny-qwen2" / "config.json").read_text())
    (forged / "tokenizer.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 16]}}).encode()
    (forged / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    manifests = home / ".ollama" / "models" / "manifests" / "registry.ollama.ai" / "library"
    (manifests / "a-list" / "latest").parent.mkdir(parents=True)
    (manifests / "a-list" / "latest").write_text("[1, 2]")
    (manifests / "numbers" / "latest").parent.mkdir(parents=True)
    (manifests / "numbers" / "latest").write_text('{"layers": [5, 6]}')
    (home / ".cache" / "huggingface" / "hub" / "models--kvchat--tiny-llama" / "refs" / "main").write_bytes(
        b"\xff\xfe\x00"
    )
    cache = tmp_path / "models.json"
    cache.write_text(json.dumps({"version": 1, "rows": {"x": {"name": 1, "bogus": True}}}))
    env = {"HOME": str(home)}
    rows = {r.name: r for r in scan([home / "models"], env=env, home=home, cache=cache)}
    assert NAMES <= set(rows)  # every good model, the one behind the unreadable refs/main included
    assert (
        not rows["forged"].openable and "claims" in rows["forged"].reason and "the file holds" in rows["forged"].reason
    )
    for name in ("a-list:latest", "numbers:latest"):
        assert not rows[name].openable and "manifest cannot be read" in rows[name].reason
    cache.write_text('{"version": 1, "rows": [1, 2, 3]}')  # a cache of the wrong shape: only a slower scan
    assert {r.name for r in scan([home / "models"], env=env, home=home, cache=cache)} == set(rows)


def test_the_new_families_are_listed_openable_with_their_cache_per_layer_kind(tmp_path):
    """A Gemma 3 folder and its GGUF, and a mixture: openable, with KV bytes per position and what the default
    cache allocates; the sliding layers keep a ring, so the Gemma cache is smaller than a full one."""
    from checkpoints import FAMILY_CASES, make_checkpoint
    from engine.tools.gguf_export import write_gguf

    opts = dict(FAMILY_CASES["gemma3"], max_position_embeddings=8192)
    gemma = make_checkpoint(tmp_path / "models" / "gemma", opts.pop("family"), **opts)
    write_gguf(gemma, tmp_path / "models" / "gemma.gguf", tokenizer=True)
    opts = dict(FAMILY_CASES["qwen3_moe"])
    make_checkpoint(tmp_path / "models" / "moe", opts.pop("family"), **opts)
    rows = {r.name: r for r in scan(folders=[tmp_path / "models"], env={}, home=tmp_path / "nohome")}
    assert {"gemma", "gemma.gguf", "moe"} <= set(rows)
    for name in ("gemma", "gemma.gguf", "moe"):
        assert rows[name].openable, rows[name].reason
    per = 2 * 3 * 2 * 16 * 4  # 2·L·H_kv·d·b: 3 layers, 2 KV heads of 16, float32
    for name in ("gemma", "gemma.gguf"):
        r = rows[name]
        assert r.kv_bytes_per_position == per
        assert r.kv_layers == "2 of 3 layers sliding: ≤ 1,030 positions each"  # W 6 + 1,024 spare
        assert r.kv_allocated_bytes == per // 3 * (4096 + 2 * 1030) < per * 4096
    assert rows["moe"].kv_layers is None and rows["moe"].architecture == "Qwen3MoeForCausalLM"


def test_a_gguf_row_says_what_its_weights_take_once_loaded(tmp_path):
    """A GGUF's row carries the bytes its weights take once loaded (what the Models dialog weighs against free
    memory), equal to what loading it gives: F16 held as float32, Q8_0 / Q4_0 / Q4_1 codes with their scales
    and offsets, a Q4_K_M mix whose q and k widen to int8 beside v's Q6_K, and a mixture's stacked experts
    (counted once, as its parameters are): more than the file in each."""
    from checkpoints import FAMILY_CASES, make_checkpoint
    from engine.backends import kernels
    from engine.tools import synthetic_gguf
    from engine.tools.gguf_export import write_gguf
    from engine.weights.gguf_file import GGUFModel

    if kernels.load() is None:  # without them a Q4_1 file is dequantized for torch's path
        pytest.skip(kernels.status())
    folder = make_checkpoint(tmp_path / "llama", "llama")
    models = tmp_path / "models"
    models.mkdir()
    for kind in ("F16", "Q8_0", "Q4_0", "Q4_1"):
        write_gguf(folder, models / f"m-{kind}.gguf", matrices=kind, tokenizer=True)
    synthetic_gguf.write(
        models / "m-Q4_K_M.gguf", hidden=256, layers=2, intermediate=512, vocab=300, heads=4, kv_heads=2
    )
    opts = dict(FAMILY_CASES["qwen3_moe"])
    write_gguf(make_checkpoint(tmp_path / "moe", opts.pop("family"), **opts), models / "m-moe.gguf", "Q8_0", True)
    rows = {r.name: r for r in scan(folders=[models], env={}, home=tmp_path / "nohome")}
    assert len(rows) == 6
    for name, r in rows.items():
        assert r.openable, r.reason
        loaded = load_model(r.path)
        assert r.held_bytes == loaded.facts()["weight_bytes"], name
        assert r.parameters == loaded.parameter_count, name
        in_file = sum(int(t.n_bytes) for t in GGUFModel(Path(r.path)).file_tensors)
        assert r.held_bytes > in_file * 1.05, name  # 36/34 for Q8_0 at the least


@pytest.mark.parametrize("over", [{"num_experts": 8}, {"moe_intermediate_size": 48}, {"hidden_size": 48}])
def test_a_size_the_weights_do_not_bear_out_is_refused_when_listed(tmp_path, monkeypatch, over):
    """A mixture whose config.json (or GGUF metadata) names more experts, or other sizes, than its tensors hold
    was listed as openable and failed when opened; each is now a row that names the tensor and both shapes,
    from the headers alone. The untouched files are listed openable beside them."""
    import gguf

    from checkpoints import FAMILY_CASES, make_checkpoint
    from engine.tools.gguf_export import write_gguf

    opts = dict(FAMILY_CASES["qwen3_moe"])
    good = make_checkpoint(tmp_path / "models" / "good", opts.pop("family"), **opts)
    bad = tmp_path / "models" / "bad"
    bad.mkdir()
    for f in good.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((good / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, **over}))
    write_gguf(good, tmp_path / "models" / "good.gguf", tokenizer=True)
    if "num_experts" in over:  # the GGUF's metadata says 8 experts over tensors stacking 4
        monkeypatch.setattr(
            gguf.GGUFWriter, "add_expert_count", lambda w, n, f=gguf.GGUFWriter.add_expert_count: f(w, 8)
        )
        write_gguf(good, tmp_path / "models" / "bad.gguf", tokenizer=True)
    rows = {r.name: r for r in scan(folders=[tmp_path / "models"], env={}, home=tmp_path / "nohome")}
    assert rows["good"].openable and rows["good.gguf"].openable
    for name in ("bad", "bad.gguf") if "num_experts" in over else ("bad",):
        r = rows[name]
        assert not r.openable and "tensor" in r.reason and ("the config implies" in r.reason or "missing" in r.reason)
        with pytest.raises(ModelLoadError):  # and it does not open
            load_model(r.path)
