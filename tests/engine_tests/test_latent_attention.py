"""Multi-head latent attention (DeepSeek-V2/V3): the compressed cache's bytes, the absorbed decode equal to the
expanded form, a long prompt (the expanded path) against transformers, the disk tier's round trip, the panel's
formula, and what the config refuses. (The prompt and 20 cached steps against transformers: test_parity's
deepseek cases; an edit, the prefix store, int8 K/V, quantized weights: test_families'.)"""

import pytest
import torch
from conversations import BUDGET_CHAT

from checkpoints import FAMILY_CASES, make_checkpoint
from desktop.core.panel_words import kv_formula
from engine.config import config_from_dict
from engine.disk_store import DiskStore
from engine.errors import ModelLoadError
from engine.events import Finished
from engine.kv_cache import make_cache
from engine.session import Request, Session
from engine.weights.loading import load_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def latent_dir(request, tmp_path_factory):
    opts = dict(FAMILY_CASES[request.param])
    return make_checkpoint(tmp_path_factory.mktemp(request.param), opts.pop("family"), **opts)


def test_a_position_caches_the_latent_and_the_rotary_key_once_a_layer(latent_dir):
    """L · (d_c + d_r) · b a position (3 · (32 + 8) · 4 here), in the model dtype and as int8 codes with a scale for
    each of the cache's two halves; plain attention over the same 4 heads would take L·H·(d_n + d_r + d_v)·b."""
    loaded = load_model(latent_dir, dtype="float32")
    cfg = loaded.config
    assert cfg.mla and cfg.cache_heads == 1 and cfg.cache_width == (32 + 8) // 2
    assert loaded.kv_bytes_per_position() == 3 * (32 + 8) * 4
    assert loaded.kv_bytes_per_position("int8") == 3 * ((32 + 8) + 2 * 4)
    facts = loaded.facts()
    assert facts["latent"]["plain_bytes_per_position"] == 3 * 4 * (16 + 8 + 16) * 4
    cache = make_cache(cfg, 64, torch.float32, "cpu")
    loaded.model(torch.arange(5, 15)[None], cache)
    assert cache.payload_bytes == 10 * 3 * 40 * 4 and cache.allocated_bytes == 64 * 3 * 40 * 4


def test_the_absorbed_decode_equals_the_expanded_form(latent_dir):
    """The same positions attended both ways (a few new positions over a cache, so both paths apply): the latent
    absorbed into the query and output, and the latents expanded into each head's K and V, agree to rounding."""
    loaded = load_model(latent_dir, dtype="float32")
    model = loaded.model
    ids = torch.arange(5, 40)[None]
    outs = []
    for absorb_below in (10**6, 0):  # every call absorbed; every call expanded
        for block in model.layers:
            block.attn.absorb_below = absorb_below
        cache = make_cache(loaded.config, 64, torch.float32, "cpu")
        with torch.no_grad():
            parts = [model(ids[:, :30], cache), model(ids[:, 30:33], cache), model(ids[:, 33:], cache)]
        outs.append(torch.cat(parts, 1))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_a_long_prompt_then_decode_matches_transformers(latent_dir):
    """40 positions: a 30-position prompt (past the absorbing threshold: the expanded path) then 10 decode steps
    (absorbed), within 1e-4 of transformers; then bfloat16 stays close."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(latent_dir, dtype=torch.float32).eval()
    ids = torch.randint(5, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids).logits
    loaded = load_model(latent_dir, dtype="float32")
    assert 30 >= loaded.model.layers[0].attn.absorb_below
    cache = make_cache(loaded.config, 64, torch.float32, "cpu")
    with torch.no_grad():
        got = [loaded.model(ids[:, :30], cache)] + [loaded.model(ids[:, t : t + 1], cache) for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-4, atol=1e-4)


def test_the_disk_tier_brings_the_latents_back_for_a_new_session(latent_dir, tmp_path):
    loaded = load_model(latent_dir, dtype="float32")
    first = Session(loaded, capacity=256, disk=DiskStore(tmp_path, 2**30))
    want = _reply(first)
    assert first.flush()
    again = Session(loaded, capacity=256, disk=DiskStore(tmp_path, 2**30))
    done = _reply(again)
    assert done.reuse.source == "disk" and done.reuse.reused > 0 and done.reuse.copied_bytes > 0
    assert done.token_ids == want.token_ids == _reply(Session(loaded, capacity=256)).token_ids


def _reply(session) -> Finished:
    final = list(session.generate(Request(messages=BUDGET_CHAT, max_new_tokens=10, ignore_eos=True)))[-1]
    assert isinstance(final, Finished), final
    return final


def test_the_panel_writes_the_latent_formula_beside_plain_attentions(latent_dir):
    loaded = load_model(latent_dir, dtype="float32")
    facts = loaded.facts()
    text = kv_formula(facts, [(3, 10)], None, 10, 10 * 480)
    assert text.startswith("3 · 10 · (32 + 8) · 4 = 4,800 B")
    assert "plain attention would hold 3 · 10 · 4 · (24 + 16) · 4 = 19,200 B, 4.0× the latent's" in text
    coded = kv_formula({**facts, "kv_cache": "int8"}, [(3, 10)], None, 10, 10 * 144)
    assert coded.startswith("3 · 10 · ((32 + 8)·8/8 + 2·4) = 1,440 B (int8 + scales)")


def test_the_cache_table_counts_deepseeks_latents(capsys):
    """engine/MODELS.md's table: DeepSeek-V2-Lite caches 27 · 576 · 2 bytes a position where plain attention over its
    16 heads of (192 + 128) would take 27 · 16 · 320 · 2."""
    from engine.tools.cache_table import main, rows

    lite = next(r for r in rows([4096]) if r["model"] == "DeepSeek-V2-Lite")
    assert lite["per_position"] == 27 * 576 * 2
    assert lite["at"][4096] == (4096 * 27 * 576 * 2, 4096 * 27 * 16 * 320 * 2)
    main(["--positions", "4096"])
    assert "| DeepSeek-V2-Lite | 31,104 | 122 MiB (plain attention 1,080 MiB) |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "change,said",
    [
        ({"kv_lora_rank": 0}, "kv_lora_rank is 0"),
        ({"kv_lora_rank": 7}, "must be even"),
        ({"kv_lora_rank": 4, "qk_rope_head_dim": 8}, "at least qk_rope_head_dim"),
        ({"topk_method": "noaux_tc", "n_group": 3}, "not groups of 4 experts"),
        ({"topk_method": "random"}, "topk_method 'random'"),
        ({"first_k_dense_replace": 9}, "first_k_dense_replace is 9"),
    ],
)
def test_a_config_that_cannot_size_the_cache_is_refused_by_name(change, said):
    raw = dict(
        architectures=["DeepseekV2ForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, vocab_size=384, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
    )  # fmt: skip
    config_from_dict(raw)  # as it is: read
    with pytest.raises(ModelLoadError, match=said):
        config_from_dict({**raw, **change})


def test_drafted_replies_are_the_models_alone(latent_dir):
    """The speculative path on latent attention: lookup drafts and the int4 copy's drafts, verified as a few
    positions at once (absorbed) and rolled back where rejected, give the tokens of no drafts at all."""
    loaded = load_model(latent_dir, dtype="float32")
    prompt = tuple(range(40, 72)) + tuple(range(40, 49))  # holds its own continuation: lookup finds drafts
    want = None
    for kind in (None, "lookup", "int4"):
        events = list(Session(loaded, capacity=256).generate(
            Request(prompt_ids=prompt, max_new_tokens=24, ignore_eos=True, speculative=kind)))  # fmt: skip
        final = events[-1]
        assert isinstance(final, Finished), final
        want = want or final.token_ids
        assert final.token_ids == want, kind
        if kind is not None:
            assert final.trace["speculative"]["drafted"] > 0, kind
