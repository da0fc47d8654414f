"""Bad model folders get errors that name the problem and the file; nothing is unpickled."""

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import make_checkpoint
from engine.errors import ModelLoadError
from engine.weights.loading import load_model


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="model folder or file not found"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing config.json .*config.json"):
        load_model(path)


def test_missing_tokenizer(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="missing tokenizer.json"):
        load_model(path)


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg
    assert "config.json" in msg


def test_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_checkpoint(tmp_path, "llama")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model.layers.1.mlp.up_proj.weight.*missing.*model.safetensors"):
        load_model(path)


def test_wrong_shape(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_checkpoint(tmp_path, "llama")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:8]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"k_proj.weight' has shape \(8, 64\), config.json implies \(32, 64\)"):
        load_model(path)


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("num_hidden_layers", 10**7, "num_hidden_layers=10,000,000 but the weights hold 2 layers"),
        ("num_hidden_layers", 3, "num_hidden_layers=3 but the weights hold 2 layers"),
        ("hidden_size", 10**9, "hidden_size is 1,000,000,000: out of range"),
        ("vocab_size", 512, "vocab_size=512, hidden_size=64 but model.embed_tokens.weight is [384, 64]"),
        ("intermediate_size", -5, "intermediate_size is -5: out of range"),
        ("num_attention_heads", 0, "num_attention_heads is 0: out of range"),
        ("num_key_value_heads", 3, "not a multiple of num_key_value_heads=3"),
        ("head_dim", 15.5, "head_dim is 15.5, not a whole number"),
        ("hidden_size", "64", "hidden_size is '64', not a whole number"),
        ("rms_norm_eps", -1, "rms_norm_eps=-1.0 is out of range"),
    ],
)
def test_config_sizes_are_checked_before_anything_is_allocated(tmp_path, field, value, says):
    """A config.json is untrusted too: a size that would allocate gigabytes, a negative or zero size, a
    head count that does not divide, each an error naming the field, before any memory is taken."""
    import resource

    path = make_checkpoint(tmp_path, "llama")
    raw = json.loads((path / "config.json").read_text())
    raw[field] = value
    (path / "config.json").write_text(json.dumps(raw))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    assert says in str(e.value) and "config.json" in str(e.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KiB


def test_truncated_safetensors(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"corrupt or truncated safetensors file.*model.safetensors"):
        load_model(path)


def test_garbage_safetensors(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    (path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(path)


def test_pickle_only_folder_is_refused_without_unpickling(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    (path / "model.safetensors").unlink()
    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (path / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(ModelLoadError, match=r"only pickle weights found \(pytorch_model.bin\).*never unpickles"):
        load_model(path)
    assert not marker.exists()


def test_bad_json(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(path)


def test_bad_template_syntax(tmp_path):
    path = make_checkpoint(tmp_path, "llama", chat_template="{% for %}")
    with pytest.raises(ModelLoadError, match=r"chat template does not parse.*tokenizer_config.json"):
        load_model(path)


def test_bad_dtype_and_device(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    with pytest.raises(ModelLoadError, match="dtype 'int3' is not supported"):
        load_model(path, dtype="int3")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA GPU"):
            load_model(path, device="cuda")


def test_cli_reports_the_error_and_exits_nonzero(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    (path / "model.safetensors").write_bytes(b"junk")
    r = subprocess.run([sys.executable, "-m", "engine", "info", "--model", str(path)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "corrupt or truncated safetensors" in r.stderr and "model.safetensors" in r.stderr
    assert "Traceback" not in r.stderr


def hub_cache_layout(src, root):
    """A model as the Hugging Face tools keep it: models--ORG--NAME/snapshots/REV/ whose every file is a
    symlink into ../../blobs/ (content-addressed)."""
    import hashlib
    import os

    repo = root / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    return snap


def test_a_sharded_model_in_the_hub_cache_opens(tmp_path):
    """Shards that are symlinks the cache made open; the same logits as the folder they came from."""
    import torch

    src = make_checkpoint(tmp_path / "src", "llama", shards=True)
    assert (src / "model.safetensors.index.json").is_file()
    snap = hub_cache_layout(src, tmp_path / "hub")
    assert all(p.is_symlink() for p in snap.iterdir())
    ids = torch.arange(5, 17)[None]
    with torch.inference_mode():
        want = load_model(src).model(ids)
        got = load_model(snap).model(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", ".."])
def test_a_shard_index_naming_a_file_outside_the_folder_is_refused(tmp_path, name):
    path = make_checkpoint(tmp_path, "llama", shards=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = name
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="points outside the model folder"):
        load_model(path)


MIXTURE = dict(architectures=["MixtralForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2)  # fmt: skip


@pytest.mark.parametrize(
    "over, said",
    [
        ({"num_local_experts": 10**9}, "expert count is 1000000000"),
        ({"num_experts_per_tok": 0}, "to 0 experts"),
        ({"num_experts_per_tok": 5}, "to 5 experts"),
        ({"num_experts_per_tok": float("nan")}, "to nan experts"),
        ({"sliding_window": -1}, "sliding_window is -1"),
        ({"moe_intermediate_size": 10**12}, "moe_intermediate_size is 1000000000000"),
    ],
)
def test_counts_a_model_is_sized_from_are_checked_before_anything_is_built(over, said, tmp_path):
    """An expert count of 10^9 built a name per expert (3.4 GB, then MemoryError); experts per token of 0 or
    above the count, a window of −1, an intermediate size of 10^12 loaded and failed later or silently. Each is
    now refused where the config is read, so `engine models` lists it as not openable with the reason."""
    from engine.config import config_from_dict
    from engine.weights.catalog import scan

    with pytest.raises(ModelLoadError, match=re.escape(said)):
        config_from_dict({**MIXTURE, **over})
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**MIXTURE, **over}))
    (folder / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    rows = [r for r in scan([tmp_path], env={}, home=tmp_path / "home") if Path(r.path) == folder]
    assert len(rows) == 1 and not rows[0].openable and said in rows[0].reason
