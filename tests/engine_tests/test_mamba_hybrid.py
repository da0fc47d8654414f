"""Granite 4.0-H, a hybrid whose state layers are Mamba-2 mixers: a state far larger than a convolution's, so its
snapshots come further apart (the block that ends at one carries it); an edit going back to the last snapshot, or
within the last positions to a base the mixer runs on from; the prefix store and the disk tier bringing snapshots
back; the config's refusals. (Drafts taken back to a base: test_hybrid's, for both hybrids. The prompt and 20
cached steps against transformers on every kernel variant: test_parity's granitemoehybrid case.)"""

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
from engine.disk_store import SUFFIX
from engine.errors import ModelLoadError
from engine.kv_cache import make_cache
from engine.session import Request, Session
from engine.state_cache import RECENT, snapshot_spacing
from engine.weights.loading import load_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    # three Mamba-2 layers beside one of attention: snapshots further apart than a block (test_families' case has
    # two of each, every 16)
    opts = dict(FAMILY_CASES["granitemoehybrid"], max_position_embeddings=1024,
                layer_types=["mamba", "attention", "mamba", "mamba"])  # fmt: skip
    path = make_checkpoint(tmp_path_factory.mktemp("granite_h"), opts.pop("family"), **opts)
    return load_model(path, dtype="float32")


def test_the_state_is_the_same_size_at_any_length_and_its_snapshots_come_further_apart(granite):
    """3 Mamba-2 layers: each its convolution's inputs (C_m = 128 + 2 · 2 · 16 = 192 channels, K_m − 1 = 3) and its
    scan's state (4 heads · 32 · 16) in float32, whatever the length; one attention layer's K/V a position. A
    snapshot of all three takes 3 · 2,624 · 4 bytes: spread over 16 positions, more than 4 × the K/V's 256, so one
    every 32."""
    cache = state_stays_beside_kv_that_grows(granite, "mamba")
    assert cache.bytes_per_position == 2 * 1 * 2 * 16 * 4 == granite.kv_bytes_per_position()
    assert cache.state_bytes == 3 * (192 * 3 + 4 * 32 * 16) * 4
    assert cache.every == snapshot_spacing(3 * (192 * 3 + 4 * 32 * 16), 4, 256) == 32


def test_long_prompts_in_chunks_and_cuts_to_a_snapshot_or_a_base_equal_transformers(granite):
    cuts_equal_transformers(granite)


def test_the_inputs_kept_for_going_back_stay_few_after_a_long_prompt(granite):
    cache = make_cache(granite.config, 1024, torch.float32, "cpu")
    with torch.no_grad():
        granite.model(torch.arange(5, 805)[None] % 300 + 5, cache)
        for t in range(3):
            granite.model(torch.tensor([[7 + t]]), cache)
    for j in range(len(cache.conv)):
        first = cache.bases[j][0][0]
        assert 803 - first <= 2 * RECENT and sum(dt.shape[1] for _, dt in cache.inputs[j]) == 803 - first
    assert cache.resumable(803 - RECENT) and not cache.resumable(700)  # 700: no snapshot (every 32) nor a base


def test_an_edit_recomputes_from_the_last_snapshot_before_it_and_the_store_brings_it_back(granite):
    edit_back_to_a_snapshot(granite, "3 Mamba-2 layers")


def test_the_disk_tier_brings_the_snapshots_back_and_other_blocks_carry_none(granite, tmp_path):
    def two_sizes(folder):  # a block with a snapshot, and one without
        sizes = sorted({p.stat().st_size for p in folder.rglob(f"*{SUFFIX}")})
        assert len(sizes) == 2 and sizes[1] - sizes[0] > 3 * 2624 * 4

    disk_tier_brings_snapshots_back(granite, tmp_path, every=32, flushed=two_sizes)


def test_the_facts_and_the_models_dialog_say_what_the_state_takes(granite):
    from engine.weights.catalog import _folder_row

    facts = Session(granite, capacity=512).facts()
    assert facts["state"] == {"layers": 3, "hidden": 192, "width": 3, "bytes": 3 * 2624 * 4, "every": 32,
                              "snapshot_bytes_per_position": 3 * 16 * 164 * 4 // 32, "kind": "mamba",
                              "scan": 4 * 32 * 16, "value_bytes": 4}  # fmt: skip
    assert "3 of 4 layers Mamba-2 (heads 4 × 32, state 16, groups 2, width 4)" in facts["fingerprint"]["attention"]
    found = _folder_row(granite.path, "granitemoehybrid", "folder")
    assert found.kv_bytes_per_position == 2 * 2 * 16 * 4
    assert found.kv_layers.startswith("3 of 4 layers Mamba-2: a state of 31 KiB at any length, a snapshot")
    assert found.kv_layers_short == "3/4 mamba, state 31 KiB"


def test_bfloat16_stays_close_to_transformers(granite):
    bfloat16_close_to_transformers(granite)


RAW = dict(architectures=["GraniteMoeHybridForCausalLM"], hidden_size=64, intermediate_size=32, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, vocab_size=384, num_local_experts=0,
           shared_intermediate_size=96, layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=4,
           mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2)  # fmt: skip


@pytest.mark.parametrize(
    "change,said",
    [
        ({"layer_types": ["mamba", "attention"]}, "must name each of the 4 layers"),
        ({"layer_types": ["mamba", "conv", "mamba", "mamba"]}, "must name each of the 4 layers"),
        ({"mamba_n_heads": 3}, "do not make its width 128"),
        ({"mamba_d_head": 16}, "do not make its width 128"),
        ({"mamba_n_groups": 3, "mamba_n_heads": 4}, "multiple of mamba_n_groups"),
        ({"mamba_d_conv": 1}, "mamba_d_conv is 1"),
        ({"mamba_d_state": 0}, "mamba_d_state is 0"),
        ({"time_step_limit": [1.0, 0.5]}, "low end above its high end"),
        ({"time_step_limit": ["x", 1]}, "two numbers from 0 up"),
    ],
)
def test_a_config_that_cannot_size_the_state_is_refused_by_name(change, said):
    cfg = config_from_dict(dict(RAW, time_step_limit=[0.0, {"__float__": "Infinity"}]))
    assert cfg.mamba_layers == (True, False, True, True) and cfg.dt_limit == (0.0, float("inf"))
    assert cfg.rope_layers == (False,) * 4 and cfg.intermediate_size == 96 and cfg.num_experts == 0
    with pytest.raises(ModelLoadError, match=said):
        config_from_dict({**RAW, **change})


MOE = dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_local_experts=4, num_experts_per_tok=2,
           intermediate_size=32, shared_intermediate_size=48, mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=1,
           position_embedding_type="rope", residual_multiplier=0.5)  # fmt: skip


def test_the_experts_form_reads_its_fused_tensors_and_its_gguf_runs_in_llama_cpp(tmp_path):
    """Granite 4.0-H-Tiny's shape in small: the experts' parts read as rows of the stacked input_linear and
    output_linear, the shared MLP beside them; rotated attention. Its GGUF (the experts stacked as llama.cpp's
    converter writes them, the shared MLP as *_shexp) gives the folder's logits, and llama.cpp's greedy tokens on it
    equal kvchat's; int4 weights decode as they prefill."""
    import importlib.util

    from engine.tools.gguf_export import write_gguf

    path = make_checkpoint(tmp_path / "moe", "granitemoehybrid", **MOE)
    folder = load_model(path, dtype="float32")
    assert folder.config.num_experts == 4 and folder.config.shared_width == 48 and not folder.config.rope_layers
    gguf_path = write_gguf(path, tmp_path / "m.gguf", tokenizer=True)
    gguf = load_model(gguf_path, dtype="float32")
    ids = torch.arange(5, 60).view(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(gguf.model(ids), folder.model(ids), rtol=1e-5, atol=1e-5)
    prompt = list(range(5, 45))
    events = list(Session(gguf, capacity=128).generate(Request(prompt_ids=tuple(prompt), max_new_tokens=16,
                                                               ignore_eos=True)))  # fmt: skip
    if importlib.util.find_spec("llama_cpp") is not None:
        from engine.tools.llamacpp import LlamaCpp

        lc = LlamaCpp(gguf_path, n_ctx=128, threads=1)
        ids_cpp, _, _ = lc.generate(prompt, 16)
        lc.close()
        assert ids_cpp == list(events[-1].token_ids)
    quant = load_model(path, weights="int4")
    cache = make_cache(quant.config, 64, quant.dtype, "cpu")
    with torch.no_grad():
        quant.model(ids[:, :-1], cache)
        step, whole = quant.model(ids[:, -1:], cache)[0, -1], quant.model(ids)[0, -1]
    assert float((step - whole).abs().max() / whole.abs().max()) < 2e-3


def test_positions_brought_in_after_a_cut_restore_their_snapshot_not_the_state_left_there(granite):
    """A cut to 64, then positions 64–95 of another branch brought in whole (as the store brings them) up to where the
    cache stood before the cut: the state comes from their snapshot at 96, not from the old branch's live state that
    happened to be at 96 too."""
    a = torch.arange(5, 105)[None] % 300 + 5
    b = a.clone()
    b[:, 70:] = (b[:, 70:] + 11) % 300 + 5
    mine, theirs = (make_cache(granite.config, 256, torch.float32, "cpu") for _ in range(2))
    with torch.no_grad():
        granite.model(a[:, :96], mine)
        granite.model(b[:, :96], theirs)
        mine.truncate(64)
        for s in (64, 80):
            mine.give(s, s + 16, theirs.take(s, s + 16))
        mine.length = 96
        torch.testing.assert_close(granite.model(b[:, 96:100], mine), granite.model(b[:, :100])[:, 96:])
