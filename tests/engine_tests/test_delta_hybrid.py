"""Qwen3-Next, a hybrid whose state layers are gated DeltaNets: a state of a matrix per value head, so its snapshots
come further apart than a block; an edit going back to the last snapshot, or within the last positions to a base
the rule runs on from; the prefix store and the disk tier bringing snapshots back; its checkpoint's interleaved
projections and its GGUF forms (llama.cpp's current one, the older interleaved `ssm_in`, quantized rows); the
config's refusals. (Drafts taken back to a base: test_hybrid's. The prompt and 20 cached steps against transformers
on every kernel variant: test_parity's qwen3_next cases. llama.cpp's greedy tokens: test_families'.)"""

import numpy as np
import pytest
import torch
from hybrid_checks import (
    bfloat16_close_to_transformers,
    cuts_equal_transformers,
    disk_tier_brings_snapshots_back,
    edit_back_to_a_snapshot,
    state_stays_beside_kv_that_grows,
)

from checkpoints import FAMILY_CASES, make_checkpoint
from engine.config import config_from_dict
from engine.errors import ModelLoadError
from engine.session import Session
from engine.state_cache import snapshot_spacing
from engine.weights.loading import load_model

transformers = pytest.importorskip("transformers")

STATE = 128 * 3 + 4 * 16 * 16  # a layer's: its convolution's last 3 inputs of 128 channels, and 4 matrices 16 × 16


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    # three DeltaNets (key heads 2 × 16, value heads 4 × 16) before one attention layer: snapshots further apart than
    # a block (test_families' case, with 12-wide heads, has one every 16)
    opts = dict(FAMILY_CASES["qwen3_next"], max_position_embeddings=1024, linear_key_head_dim=16,
                linear_value_head_dim=16)  # fmt: skip
    path = make_checkpoint(tmp_path_factory.mktemp("qwen3_next"), opts.pop("family"), **opts)
    return load_model(path, dtype="float32")


def test_the_state_is_the_same_size_at_any_length_and_its_snapshots_come_further_apart(qwen):
    """3 DeltaNets: each its convolution's inputs (2 · 2 · 16 + 4 · 16 = 128 channels, K − 1 = 3) and its 4 matrices
    [16, 16] in float32, whatever the length; one attention layer's K/V a position. A snapshot of the three takes
    3 · 1,408 · 4 bytes: spread over 16 positions, more than 4 × the K/V's 256, so one every 32."""
    cache = state_stays_beside_kv_that_grows(qwen, "delta")
    assert cache.kind == "delta" and cache.bytes_per_position == 2 * 1 * 2 * 16 * 4 == qwen.kv_bytes_per_position()
    assert cache.state_bytes == 3 * STATE * 4
    assert cache.every == snapshot_spacing(3 * STATE, 4, 256) == 32


def test_long_prompts_in_chunks_and_cuts_to_a_snapshot_or_a_base_equal_transformers(qwen):
    cuts_equal_transformers(qwen)


def test_an_edit_recomputes_from_the_last_snapshot_before_it_and_the_store_brings_it_back(qwen):
    edit_back_to_a_snapshot(qwen, "3 gated DeltaNet layers")


def test_the_disk_tier_brings_the_snapshots_back(qwen, tmp_path):
    disk_tier_brings_snapshots_back(qwen, tmp_path, every=32)


def test_the_facts_and_the_models_dialog_say_what_the_state_takes(qwen):
    from engine.weights.catalog import _folder_row

    facts = Session(qwen, capacity=512).facts()
    assert facts["state"] == {"layers": 3, "hidden": 128, "width": 3, "bytes": 3 * STATE * 4, "every": 32,
                              "snapshot_bytes_per_position": 3 * 16 * 88 * 4 // 32, "kind": "delta",
                              "scan": 4 * 16 * 16, "value_bytes": 4}  # fmt: skip
    said = facts["fingerprint"]["attention"]
    assert "3 of 4 layers gated DeltaNet (key heads 2 × 16, value heads 4 × 16, width 4)" in said
    assert "gated attention output" in said
    found = _folder_row(qwen.path, "qwen3_next", "folder")
    assert found.kv_bytes_per_position == 2 * 2 * 16 * 4
    assert found.kv_layers.startswith("3 of 4 layers gated DeltaNet: a state of 16 KiB at any length, a snapshot")
    assert found.kv_layers_short == "3/4 delta, state 16 KiB"


def test_bfloat16_stays_close_to_transformers(qwen):
    bfloat16_close_to_transformers(qwen)


def _legacy(gguf_path, folder, out):
    """The GGUF as llama.cpp's converter wrote Qwen3-Next before it split q/k/v from z: attn_qkv and attn_gate
    replaced by the checkpoint's interleaved in_proj_qkvz as `ssm_in`."""
    import gguf
    from safetensors import safe_open

    src = gguf.GGUFReader(str(gguf_path))
    w = gguf.GGUFWriter(str(out), "qwen3next")
    for field in src.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            values = [field.contents(i) for i in range(len(field.data))]
            w.add_array(field.name, values)
        else:
            w.add_key_value(field.name, field.contents(), kind)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for t in src.tensors:
            if t.name.endswith("attn_gate.weight"):
                continue
            if t.name.endswith("attn_qkv.weight"):
                i = t.name.split(".")[1]
                w.add_tensor(f"blk.{i}.ssm_in.weight", f.get_tensor(f"model.layers.{i}.linear_attn.in_proj_qkvz.weight")
                             .float().numpy())  # fmt: skip
            else:
                w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed([int(d) for d in t.shape])),
                             raw_dtype=t.tensor_type)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_the_gguf_forms_read_the_interleaved_rows_as_the_folder_does(qwen, tmp_path):
    """An older file's ssm_in (q, k, v, z interleaved per key head, as the checkpoint holds them) gives the folder's
    logits as the current form does; quantized (Q8_0, Q4_0), each part's rows are picked from the file's own codes
    (b and a out of ssm_ba, in the kernels' one pass) as the float file's are."""
    from engine.tools.gguf_export import write_gguf

    current = write_gguf(qwen.path, tmp_path / "m.gguf", tokenizer=True)
    legacy = load_model(_legacy(current, qwen.path, tmp_path / "old.gguf"), dtype="float32")
    ids = torch.arange(5, 60).view(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(legacy.model(ids), qwen.model(ids), rtol=1e-5, atol=1e-5)
    want = qwen.model.layers[0].attn.in_proj.weight  # [C + H_v·d_v + 2·H_v, D]: q/k/v, z, b, a
    for kind, tolerance in (("Q8_0", 0.01), ("Q4_0", 0.15)):
        quant = load_model(write_gguf(qwen.path, tmp_path / f"{kind}.gguf", matrices=kind, tokenizer=True))
        got = quant.model.layers[0].attn.in_proj.dequantized_weight(torch.float32)
        assert float(((got - want).abs().amax(1) / want.abs().amax(1)).max()) < tolerance, kind


RAW = dict(architectures=["Qwen3NextForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384, num_experts=4,
           num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, linear_num_key_heads=2,
           linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)  # fmt: skip


@pytest.mark.parametrize(
    "change,said",
    [
        ({"layer_types": ["linear_attention", "full_attention"]}, "must name each of the 4 layers"),
        ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, "must name each"),
        ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
        ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim is 1"),
        ({"linear_key_head_dim": 0}, "linear_key_head_dim is 0"),
        ({"full_attention_interval": 0}, "full_attention_interval is 0"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step is 0"),
    ],
)
def test_a_config_that_cannot_size_the_state_is_refused_by_name(change, said):
    cfg = config_from_dict(dict(RAW))
    assert cfg.delta_layers == (True, True, True, False) and cfg.rope.partial == 0.25 and cfg.norm_offset == 1.0
    assert cfg.attn_output_gate and cfg.shared_gate and cfg.shared_width == 48 and cfg.delta_conv_width == 128
    with pytest.raises(ModelLoadError, match=said):
        config_from_dict({**RAW, **change})
