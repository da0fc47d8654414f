"""A hybrid's cache (LFM2: short convolutions on some layers, attention on the others): the state of the convolution
layers the same at any length beside K/V that grow; an edit going back to the last snapshot before it; the disk tier
bringing snapshots back with the blocks; drafts rolled back within the last positions; the config's refusals. (The
prompt and 20 cached steps against transformers: test_parity's lfm2 case; a chat, an edit through the prefix store,
the GGUF form and llama.cpp's tokens: test_families'.)"""

import pytest
import torch
from hybrid_checks import disk_tier_brings_snapshots_back, reply

from checkpoints import FAMILY_CASES, make_checkpoint
from engine.config import config_from_dict
from engine.errors import ModelLoadError
from engine.kv_cache import make_cache
from engine.session import Session
from engine.state_cache import SNAPSHOT
from engine.weights.loading import load_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    opts = dict(FAMILY_CASES["lfm2"])
    return load_model(make_checkpoint(tmp_path_factory.mktemp("lfm2"), opts.pop("family"), **opts), dtype="float32")


def test_the_state_is_the_same_size_at_any_length_beside_kv_that_grows(lfm2):
    """2 attention layers' K/V a position (2 · 2 · 2 heads · 16 · 4 bytes), 2 convolution layers' state of
    D · (K − 1) values each whatever the length; a snapshot every 16 positions."""
    cfg = lfm2.config
    cache = make_cache(cfg, 64, torch.float32, "cpu")
    assert cache.bytes_per_position == 2 * 2 * 2 * 16 * 4 == lfm2.kv_bytes_per_position()
    assert cache.state_bytes == 2 * 64 * 2 * 4
    sizes = []
    for n in (10, 40):
        cache.truncate(0)
        lfm2.model(torch.arange(5, 5 + n)[None], cache)
        kinds = {k["kind"]: k for k in cache.kinds()}
        sizes.append((kinds["conv"]["payload_bytes"], kinds["full"]["payload_bytes"], kinds["conv"]["snapshots"]))
        assert cache.payload_bytes == kinds["full"]["payload_bytes"] + cache.state_bytes
    assert sizes[0][0] == sizes[1][0] == cache.state_bytes  # the state: the same at 10 and 40 positions
    assert sizes[1][1] == 4 * sizes[0][1]  # K/V: four times the positions, four times the bytes
    assert (sizes[0][2], sizes[1][2]) == (10 // SNAPSHOT, 40 // SNAPSHOT)


def test_a_cut_goes_back_to_a_snapshot_or_within_the_last_positions_and_nowhere_else(lfm2):
    ids = torch.arange(5, 105)[None]
    cache = make_cache(lfm2.config, 128, torch.float32, "cpu")
    with torch.no_grad():
        want = lfm2.model(ids)
        lfm2.model(ids[:, :90], cache)
        for cut in (80, 64, 32):  # a position among the last 64; then snapshots
            cache.truncate(cut)
            torch.testing.assert_close(lfm2.model(ids[:, cut : cut + 3], cache), want[:, cut : cut + 3])
            cache.truncate(cut)
        with pytest.raises(ValueError, match="no snapshot"):
            cache.truncate(20)  # neither a snapshot nor among the last positions


def test_an_edit_recomputes_from_the_last_snapshot_before_it_and_the_report_says_so(lfm2):
    session = Session(lfm2, capacity=256)
    first = [{"role": "user", "content": "I am planning a trip to Chengdu for 3 nights, on a budget."}]
    reply(session, messages=first)
    edited = [{"role": "user", "content": "I am planning a trip to Chengdu for 4 nights, on a budget."}]
    done, start = reply(session, messages=edited)
    r = start.reuse
    cut = r.first_invalidated_position
    assert r.reused == cut // SNAPSHOT * SNAPSHOT < cut and r.source == "working"
    assert f"snapshot of it every {SNAPSHOT} positions; the last before {cut} is at {r.reused}" in r.reason
    assert done.token_ids == reply(Session(lfm2, capacity=256), messages=edited)[0].token_ids
    back, start = reply(session, messages=first)  # the first branch again: its blocks, snapshots with them
    assert start.reuse.source == "store" and start.reuse.reused % SNAPSHOT == 0 and start.reuse.reused > cut
    assert back.token_ids == reply(Session(lfm2, capacity=256), messages=first)[0].token_ids


def test_the_disk_tier_brings_the_snapshots_back_with_the_blocks(lfm2, tmp_path):
    disk_tier_brings_snapshots_back(lfm2, tmp_path, every=SNAPSHOT, capacity=256)


@pytest.fixture(scope="module", params=["lfm2", "granite-h", "qwen3-next"])
def hybrid(request, lfm2, tmp_path_factory):
    """Each hybrid: LFM2 (a convolution's state, its last inputs), Granite 4.0-H (a Mamba-2 state, snapshots every
    32 positions, bases its mixer runs on from) and Qwen3-Next (a gated DeltaNet's state, bases likewise)."""
    if request.param == "lfm2":
        return lfm2
    if request.param == "qwen3-next":
        opts = dict(FAMILY_CASES["qwen3_next"])
    else:
        opts = dict(FAMILY_CASES["granitemoehybrid"], layer_types=["mamba", "attention", "mamba", "mamba"])
    return load_model(make_checkpoint(tmp_path_factory.mktemp("hybrid"), opts.pop("family"), **opts))


def test_drafts_are_taken_back_within_the_last_positions_and_replies_are_the_models_alone(hybrid):
    prompt = tuple(range(40, 72)) + tuple(range(40, 49))
    want = None
    for kind in (None, "lookup", "int4"):
        done, _ = reply(Session(hybrid, capacity=256), prompt_ids=prompt, max_new_tokens=24, speculative=kind)
        want = want or done.token_ids
        assert done.token_ids == want, kind
        copies = hybrid.config.family != "qwen3_next"  # (its tiny reply repeats no n-gram: no lookup draft to take)
        if kind == "int4" or (kind == "lookup" and copies):
            assert done.trace["speculative"]["drafted"] > 0
        if kind == "int4":  # the int4 model's drafts part from the model's somewhere: taken back
            assert done.trace["speculative"]["rolled_back"] > 0


def test_the_facts_say_what_the_state_takes(lfm2):
    facts = Session(lfm2, capacity=256).facts()
    assert facts["state"] == {"layers": 2, "hidden": 64, "width": 2, "bytes": 2 * 64 * 2 * 4, "every": SNAPSHOT,
                              "snapshot_bytes_per_position": 2 * 8 * 4}  # fmt: skip
    assert facts["kv_layer_kinds"] == [{"kind": "full", "layers": 2, "window": None, "slots": 256}]
    assert "2 of 4 layers short convolutions (width 3)" in facts["fingerprint"]["attention"]


@pytest.mark.parametrize(
    "change,said",
    [
        ({"layer_types": ["conv", "full_attention"]}, "must name each of the 4 layers"),
        ({"layer_types": ["conv", "mamba", "conv", "conv"]}, "must name each of the 4 layers"),
        ({"conv_L_cache": 1}, "conv_L_cache is 1"),
    ],
)
def test_a_config_that_cannot_size_the_state_is_refused_by_name(change, said):
    raw = dict(architectures=["Lfm2ForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=384,
               layer_types=["conv", "full_attention", "conv", "full_attention"])  # fmt: skip
    assert config_from_dict(raw).conv_layers == (True, False, True, False)
    with pytest.raises(ModelLoadError, match=said):
        config_from_dict({**raw, **change})


def test_the_cache_table_counts_lfm2s_state_and_snapshots():
    """engine/MODELS.md's table: LFM2-1.2B keeps K/V on 6 of its 16 layers (12,288 bytes a position in bfloat16), its
    10 convolution layers' state (80 KiB) and their snapshots (5,120 bytes a position); plain attention on all 16."""
    from engine.tools.cache_table import rows

    lfm2 = next(r for r in rows([4096]) if r["model"].startswith("LFM2"))
    assert lfm2["per_position"] == 6 * 2 * 8 * 64 * 2
    assert lfm2["at"][4096] == (4096 * (12288 + 5120) + 10 * 2048 * 2 * 2, 16 * 4096 * 2 * 8 * 64 * 2)


def test_the_models_dialog_gives_the_state_beside_the_kv_bytes(lfm2):
    """The catalog's figures for a hybrid folder, before any weight is read: K/V bytes a position (its attention
    layers'), the state in words, the allocation at the capacity counting the state and its snapshots."""
    from engine.weights.catalog import _folder_row

    found = _folder_row(lfm2.path, "lfm2", "folder")
    assert found.kv_bytes_per_position == 2 * 2 * 2 * 16 * 4
    assert (
        found.kv_layers == "2 of 4 layers short convolutions: a state of 1 KiB at any length, a snapshot of it "
        "every 16 positions"
    )
    assert found.kv_layers_short == "2/4 conv, state 1 KiB"
