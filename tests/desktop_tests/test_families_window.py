"""The new families in the real window: a mixture of experts and a Gemma 3 checkpoint open, chat, and the panel
says what sets them apart (active parameters and bytes read per token; windows per layer kind)."""

import pytest
from gui import BUDGET, panel, send

from checkpoints import make_checkpoint
from desktop.core.panel_words import fmt_bytes
from engine.events import Finished

pytest.importorskip("transformers")


def test_a_mixture_of_experts_chats_and_the_panel_shows_its_active_part(qtbot, make_window, spin_loop, tmp_path):
    path = make_checkpoint(
        tmp_path / "moe",
        "qwen3_moe",
        max_position_embeddings=2048,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    w = make_window(path)
    facts = w.facts
    assert facts["architecture"] == "Qwen3MoeForCausalLM" and facts["experts"] == "2 of 8"
    assert facts["active_parameters"] < facts["parameters"]
    assert facts["active_weight_bytes"] < facts["weight_bytes"]
    assert panel(w, "parametersValue") == (
        f"{facts['parameters']:,}\n{facts['active_parameters']:,} active per token (2 of 8 experts)"
    )
    assert panel(w, "weightBytesValue") == (
        f"{fmt_bytes(facts['weight_bytes'])}\n{fmt_bytes(facts['active_weight_bytes'])} read per token"
    )
    final = send(qtbot, w, spin_loop, BUDGET)
    assert isinstance(final, Finished) and final.token_ids
    assert w.transcript.views[1].message.content == final.text


def test_a_gemma_3_checkpoint_chats_and_the_panel_names_its_sliding_layers(qtbot, make_window, spin_loop, tmp_path):
    path = make_checkpoint(
        tmp_path / "gemma",
        "gemma3",
        tie=True,
        max_position_embeddings=2048,
        num_hidden_layers=3,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )
    w = make_window(path)
    assert panel(w, "architectureValue").startswith("Gemma3ForCausalLM\nwindow 8 on 2 of 3 layers, QK norm")
    assert "dense" not in panel(w, "parametersValue") and "\n" not in panel(w, "parametersValue")
    kinds = w.facts["kv_layer_kinds"]  # the sliding layers keep a ring of W + spare slots, not the capacity
    assert [(k["kind"], k["layers"]) for k in kinds] == [("full", 1), ("sliding", 2)]
    window = kinds[1]["window"]
    assert window == 8 and kinds[1]["slots"] < w.facts["capacity"]
    final = send(qtbot, w, spin_loop, BUDGET)
    assert isinstance(final, Finished) and final.token_ids
    cache = final.cache
    assert panel(w, "kvPayloadValue") == fmt_bytes(cache["payload_bytes"])
    assert panel(w, "kvAllocatedValue") == fmt_bytes(cache["allocated_bytes"])
    assert panel(w, "diskValue").startswith("off: not for a sliding-window cache")  # the app's disk tier is on
    assert cache["allocated_bytes"] < cache["capacity"] * w.facts["kv_bytes_per_position"]
    n = cache["positions"]
    assert cache["payload_bytes"] == 2 * (n + 2 * min(n, 8)) * 2 * 16 * 4  # a sliding layer needs at most W
    assert panel(w, "kvFormulaValue") == (
        f"2 · 1 · {n} · 2 · 16 · 4 + 2 · 2 · min({n}, {window}) · 2 · 16 · 4 = {cache['payload_bytes']:,} B"
    )


def test_a_deepseek_checkpoint_chats_and_the_panel_writes_its_latent_cache(qtbot, make_window, spin_loop, tmp_path):
    """Latent attention in the real window: the architecture line names it, and after a reply the formula is the
    latent's, L · T · (d_c + d_r) · b, with what plain attention over the same heads would hold beside it."""
    from checkpoints import FAMILY_CASES

    opts = dict(FAMILY_CASES["deepseek_v3"], max_position_embeddings=2048)
    w = make_window(make_checkpoint(tmp_path / "deepseek", opts.pop("family"), **opts))
    assert "latent attention (d_c 32, d_r 8, d_n 16, d_v 16, pairs interleaved)" in panel(w, "architectureValue")
    final = send(qtbot, w, spin_loop, BUDGET)
    assert isinstance(final, Finished) and final.token_ids
    n, payload = final.cache["positions"], final.cache["payload_bytes"]
    assert payload == n * 3 * (32 + 8) * 4 and panel(w, "kvPayloadValue") == fmt_bytes(payload)
    plain = n * 3 * 4 * (24 + 16) * 4
    assert panel(w, "kvFormulaValue") == (
        f"3 · {n} · (32 + 8) · 4 = {payload:,} B · plain attention would hold 3 · {n} · 4 · (24 + 16) · 4 = "
        f"{plain:,} B, 4.0× the latent's"
    )
    assert w.statsPanel.formula_label().text() == "L·T·(d_c+d_r)·b"


def test_a_hybrid_chats_and_the_panel_shows_its_state_beside_its_kv(qtbot, make_window, spin_loop, tmp_path):
    """LFM2 in the real window: the State row gives the convolution layers' state (the same at any length) and the
    snapshots kept so far; the payload and the formula count the attention layers' K/V and that state."""
    from checkpoints import FAMILY_CASES

    opts = dict(FAMILY_CASES["lfm2"], max_position_embeddings=2048)
    w = make_window(make_checkpoint(tmp_path / "lfm2", opts.pop("family"), **opts))
    assert "2 of 4 layers short convolutions (width 3)" in panel(w, "architectureValue")
    final = send(qtbot, w, spin_loop, BUDGET)
    assert isinstance(final, Finished) and final.token_ids
    n, payload = final.cache["positions"], final.cache["payload_bytes"]
    state = 2 * 64 * 2 * 4  # 2 layers · D · (K − 1) · 4 bytes
    assert payload == 2 * 2 * n * 2 * 16 * 4 + state and panel(w, "kvPayloadValue") == fmt_bytes(payload)
    assert panel(w, "stateValue") == (
        f"2 convolution layers: {fmt_bytes(state)}, the same at any length · {n // 16:,} snapshots (one every 16 "
        f"positions): {fmt_bytes(n // 16 * 16 * 2 * 8 * 4)}"
    )
    assert panel(w, "kvFormulaValue") == f"2 · 2 · {n} · 2 · 16 · 4 + 2 · 64 · 2 · 4 (state) = {payload:,} B"
    assert w.statsPanel.formula_label().text() == "2·L·T·H_kv·d·b + state"
    said = w.chat.cache_map.describe(0, 40)  # the map's words for positions 0–39: the snapshots among them
    assert "The convolution layers' state is kept after position 15, 31 (each snapshot covers every" in said
    assert "state is kept" not in w.chat.cache_map.describe(16, 31)


def test_a_mamba_hybrid_chats_and_the_panel_shows_its_state_and_sparser_snapshots(qtbot, make_window, spin_loop,
                                                                                   tmp_path):  # fmt: skip
    """Granite 4.0-H in the real window: the State row names the Mamba-2 layers and their snapshots (every 32
    positions here: its state is large beside one attention layer's K/V); the formula adds each layer's
    convolution inputs and scan state, in float32; the map's words say where the snapshots are."""
    from checkpoints import FAMILY_CASES

    opts = dict(FAMILY_CASES["granitemoehybrid"], max_position_embeddings=2048,
                layer_types=["mamba", "attention", "mamba", "mamba"])  # fmt: skip
    w = make_window(make_checkpoint(tmp_path / "granite_h", opts.pop("family"), **opts))
    assert "3 of 4 layers Mamba-2 (heads 4 × 32, state 16, groups 2, width 4)" in panel(w, "architectureValue")
    final = send(qtbot, w, spin_loop, BUDGET)
    assert isinstance(final, Finished) and final.token_ids
    n, payload = final.cache["positions"], final.cache["payload_bytes"]
    state = 3 * (192 * 3 + 4 * 32 * 16) * 4  # 3 layers · (C_m · (K_m − 1) + H_m · P · N) · 4 bytes
    assert payload == 2 * 1 * n * 2 * 16 * 4 + state and panel(w, "kvPayloadValue") == fmt_bytes(payload)
    assert panel(w, "stateValue") == (
        f"3 Mamba-2 layers: {fmt_bytes(state)}, the same at any length · {n // 32:,} snapshots (one every 32 "
        f"positions): {fmt_bytes(n // 32 * 3 * 16 * 164 * 4)}"
    )
    assert panel(w, "kvFormulaValue") == f"2 · 1 · {n} · 2 · 16 · 4 + 3 · (192 · 3 + 2048) · 4 (state) = {payload:,} B"
    said = w.chat.cache_map.describe(0, 40)
    assert "The Mamba-2 layers' state is kept after position 31 (each snapshot covers every" in said


def test_a_deltanet_hybrid_chats_and_the_panel_shows_its_state(qtbot, make_window, spin_loop, tmp_path):
    """Qwen3-Next in the real window: the State row names the gated DeltaNet layers and their snapshots (every 32
    positions here); the formula adds each layer's convolution inputs and matrices, in float32; the map's words say
    where the snapshots are."""
    from checkpoints import FAMILY_CASES

    opts = dict(FAMILY_CASES["qwen3_next"], max_position_embeddings=2048, linear_key_head_dim=16,
                linear_value_head_dim=16)  # fmt: skip
    w = make_window(make_checkpoint(tmp_path / "qwen3_next", opts.pop("family"), **opts))
    assert "3 of 4 layers gated DeltaNet (key heads 2 × 16, value heads 4 × 16, width 4)" in panel(
        w, "architectureValue"
    )
    final = send(qtbot, w, spin_loop, BUDGET)
    assert isinstance(final, Finished) and final.token_ids
    n, payload = final.cache["positions"], final.cache["payload_bytes"]
    state = 3 * (128 * 3 + 4 * 16 * 16) * 4  # 3 layers · (C_δ · (K_δ − 1) + H_v · d_k · d_v) · 4 bytes
    assert payload == 2 * 1 * n * 2 * 16 * 4 + state and panel(w, "kvPayloadValue") == fmt_bytes(payload)
    assert panel(w, "stateValue") == (
        f"3 gated DeltaNet layers: {fmt_bytes(state)}, the same at any length · {n // 32:,} snapshots (one every 32 "
        f"positions): {fmt_bytes(n // 32 * 3 * 16 * 88 * 4)}"
    )
    assert panel(w, "kvFormulaValue") == f"2 · 1 · {n} · 2 · 16 · 4 + 3 · (128 · 3 + 1024) · 4 (state) = {payload:,} B"
    assert "The gated DeltaNet layers' state is kept after position 31" in w.chat.cache_map.describe(0, 40)
