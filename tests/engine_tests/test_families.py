"""The families beyond the Llama shape through the whole engine: a chat's greedy reply equal to transformers'
generate, cached equal to fresh through an edit and through the prefix store, what the model says of itself
(windows per layer, active parameters) and the quantized forms running."""

import importlib.util

import pytest
import torch
from conversations import BUDGET_CHAT, edit_the_first_message

from checkpoints import FAMILY_CASES as FAMILIES
from checkpoints import make_checkpoint
from engine.config import load_config
from engine.events import Finished, PrefillStarted
from engine.session import Request, Session
from engine.weights.loading import load_model

transformers = pytest.importorskip("transformers")

CHAT = BUDGET_CHAT


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    opts = dict(FAMILIES[request.param])
    # not named for the family: llama.cpp looks up Phi-3's own special tokens in a file whose name says "phi"
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), opts.pop("family"), **opts)


def reply(session, **kw):
    kw.setdefault("max_new_tokens", 10)
    kw.setdefault("ignore_eos", True)
    events = list(session.generate(Request(**kw)))
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1], next(e for e in events if isinstance(e, PrefillStarted))


def test_greedy_chat_reply_equals_transformers_generate(family_dir):
    loaded = load_model(family_dir, device="cpu", dtype="float32")
    done, start = reply(Session(loaded, capacity=128), messages=CHAT)
    prompt = torch.tensor([list(start.prompt_token_ids)])
    assert prompt.shape[1] > 8  # longer than the sliding windows above
    ref = transformers.AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32).eval()
    want = ref.generate(prompt, max_new_tokens=10, do_sample=False, min_new_tokens=10, pad_token_id=0)
    assert list(done.token_ids) == want[0, prompt.shape[1] :].tolist()


def test_cached_equals_fresh_through_an_edit_and_the_prefix_store(family_dir):
    loaded = load_model(family_dir, device="cpu", dtype="float32")
    session, follow, (again, start), fresh = edit_the_first_message(
        loaded, reply, lambda: Session(loaded, capacity=256)
    )
    assert 0 < start.reuse.reused < len(start.prompt_token_ids)  # the edit cut the cache, the head was kept
    assert again.token_ids == fresh.token_ids
    back, start = reply(session, messages=follow)  # the first conversation again: from the prefix store
    assert start.reuse.source == "store" and start.reuse.copied_positions > 0
    assert back.token_ids == reply(Session(loaded, capacity=256), messages=follow)[0].token_ids


def test_windows_and_active_parameters_as_the_config_says(tmp_path):
    gemma3 = load_model(make_checkpoint(tmp_path / "g", **FAMILIES["gemma3"]), device="cpu", dtype="float32")
    assert gemma3.config.windows == (6, 6, None)
    assert "window 6 on 2 of 3 layers" in gemma3.fingerprint["attention"]
    moe = load_model(make_checkpoint(tmp_path / "m", **FAMILIES["qwen3_moe"]), device="cpu", dtype="float32")
    m = moe.model
    expert = sum(p.numel() for p in m.layers[0].mlp.experts[0].parameters())
    assert m.parameter_count() - m.active_parameter_count() == moe.config.num_layers * (4 - 2) * expert


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_families_decode_as_they_prefill(family_dir, weights):
    """Quantized (every expert's linears too, the router kept): a decode step on the cache equals the same
    quantized model's whole recompute; int8 stays close to float32."""
    from engine.kv_cache import make_cache

    quant = load_model(family_dir, device="cpu", weights=weights)
    ids = torch.arange(5, 30).view(1, -1)
    cache = make_cache(quant.config, 64, quant.dtype, "cpu")
    quant.model(ids[:, :-1], cache)
    step = quant.model(ids[:, -1:], cache)[0, -1]  # one position: the decode kernels where the layers have them
    whole = quant.model(ids)[0, -1]
    assert float((step - whole).abs().max() / whole.abs().max()) < 2e-3
    if weights == "int8":
        want = load_model(family_dir, device="cpu", dtype="float32").model(ids)[0, -1]
        assert float((whole - want).abs().max() / want.abs().max()) < 0.08
    if quant.config.num_experts:
        mlp = next(b.mlp for b in quant.model.layers if hasattr(b.mlp, "experts"))  # DeepSeek's first layer is dense
        assert all(type(e.gate_up).__name__ == "QuantLinear" for e in mlp.mlps())  # the shared experts too
        assert type(mlp.router).__name__ == "Linear"
        # the one-call C step routes the experts itself (a plain mixture's), and agreed with the module path at load
        assert (quant.model.decode_step is not None) == quant.config.step_blocks
        assert quant.model.decode_step_refused is None


def test_the_gguf_form_equals_the_folder(family_dir, tmp_path):
    """Written as llama.cpp's converter writes the family (Gemma's norms as 1 + w, Phi-3's fused tensors and rope
    factors, a mixture's experts stacked in one tensor each): the same logits and the same greedy reply."""
    from engine.tools.gguf_export import write_gguf

    folder = load_model(family_dir, device="cpu", dtype="float32")
    gguf = load_model(write_gguf(family_dir, tmp_path / "m.gguf", tokenizer=True), device="cpu", dtype="float32")
    assert gguf.config.windows == folder.config.windows and gguf.config.family == folder.config.family
    ids = torch.arange(5, 30).view(1, -1)
    torch.testing.assert_close(gguf.model(ids), folder.model(ids), rtol=1e-5, atol=1e-5)
    assert (
        reply(Session(gguf, capacity=128), messages=CHAT)[0].token_ids
        == reply(Session(folder, capacity=128), messages=CHAT)[0].token_ids
    )


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python (the bench extra)")
def test_llama_cpp_greedy_tokens_on_the_same_gguf(family_dir, tmp_path):
    from engine.tools.gguf_export import write_gguf
    from engine.tools.llamacpp import LlamaCpp

    cfg = load_config(family_dir)
    if cfg.mla and not cfg.q_lora_rank:  # llama.cpp (0.3.36's) takes a DeepSeek without q_lora at V2-Lite's 27 layers
        opts = dict(FAMILIES["deepseek_v2"], num_hidden_layers=27)
        family_dir = make_checkpoint(tmp_path / "lite", opts.pop("family"), **opts)
    path = write_gguf(family_dir, tmp_path / "m.gguf", tokenizer=True)
    loaded = load_model(path, device="cpu", dtype="float32")
    prompt = list(range(5, 45))  # longer than the windows
    done = list(
        Session(loaded, capacity=128).generate(Request(prompt_ids=tuple(prompt), max_new_tokens=16, ignore_eos=True))
    )
    lc = LlamaCpp(path, n_ctx=128, threads=1)
    ids, _, _ = lc.generate(prompt, 16)
    lc.close()
    assert ids == list(done[-1].token_ids)


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe", "deepseek_v3", "lfm2", "granitemoehybrid", "qwen3_next"])
def test_the_server_serves_the_family_as_the_engine_runs_it(name, serve, tmp_path):
    """`python -m engine serve` on a Gemma 3 folder (a sliding-window cache: the capacity past W + spare), on a
    mixture, on DeepSeek's latent attention and on the hybrids (LFM2, Granite 4.0-H, Qwen3-Next), through the official
    client: the engine's reply, and a second turn's cached tokens."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    opts = dict(FAMILIES[name], max_position_embeddings=4096)
    path = make_checkpoint(tmp_path / "m", opts.pop("family"), **opts)
    server = serve("--model", str(path), "--capacity", "2048")
    c = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    model = c.models.list().data[0].id
    r = c.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    loaded = load_model(path)
    session = Session(loaded, capacity=2048)
    want = list(session.generate(Request(messages=CHAT, max_new_tokens=12)))[-1]
    assert r.choices[0].message.content == want.text
    turn2 = CHAT + [{"role": "assistant", "content": want.text}, {"role": "user", "content": "How much?"}]
    r2 = c.chat.completions.create(model=model, messages=turn2, max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    report = r2.model_extra["kvchat"]
    if name == "gemma3":  # the sliding layers keep a ring: allocated is below the capacity's full cache
        kinds = {k["kind"]: k for k in report["cache"]["layer_kinds"]}
        assert kinds["sliding"]["slots"] == 6 + 1024 and report["cache"]["allocated_bytes"] < 2048 * 2 * 3 * 2 * 16 * 4
    if name == "deepseek_v3":  # the latent and the rotary key a position: 3 layers · (32 + 8) · 4 bytes
        assert report["cache"]["payload_bytes"] == report["cache"]["positions"] * 3 * 40 * 4
    if name == "lfm2":  # 2 attention layers' K/V a position, and 2 convolution layers' state
        kinds = {k["kind"]: k for k in report["cache"]["layer_kinds"]}
        assert kinds["conv"]["state_bytes"] == 2 * 64 * 2 * 4 and kinds["full"]["layers"] == 2
    if name == "granitemoehybrid":  # 2 attention layers' K/V, and 2 Mamba-2 layers' state in float32
        kinds = {k["kind"]: k for k in report["cache"]["layer_kinds"]}
        assert kinds["mamba"]["state_bytes"] == 2 * (192 * 3 + 4 * 32 * 16) * 4 and kinds["full"]["layers"] == 2
    if name == "qwen3_next":  # 1 attention layer's K/V, and 3 DeltaNets' state in float32
        kinds = {k["kind"]: k for k in report["cache"]["layer_kinds"]}
        assert kinds["delta"]["state_bytes"] == 3 * (96 * 3 + 4 * 12 * 12) * 4 and kinds["full"]["layers"] == 1


def test_a_gemma_3_checkpoint_with_a_vision_tower_opens_its_text_model(tmp_path):
    """Gemma 3 4B and larger ship as Gemma3ForConditionalGeneration: the text model under language_model.model.*,
    its config under text_config (only what departs from Gemma3TextConfig's defaults). Its text-only logits equal
    transformers' on the whole checkpoint; with a tokenizer that lacks the image token it opens for text only and
    says why (engine_tests/test_vision.py runs the images)."""
    import json

    from checkpoints import CHATML, tokenizer_json

    text = dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], max_position_embeddings=512,
        pad_token_id=None, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision | {"patch_size": 14}, mm_tokens_per_image=4)
    torch.manual_seed(0)
    ref = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.08) if p.dim() >= 2 else p.uniform_(0.5, 1.5)
    ref.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "</s>"}))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:  # the layout the Hub's files have
        assert "language_model.model.embed_tokens.weight" in f.keys() and any("vision_tower" in k for k in f.keys())
    loaded = load_model(tmp_path, device="cpu", dtype="float32")
    assert loaded.config.architecture == "Gemma3ForConditionalGeneration" and loaded.config.windows == (6, 6, None)
    assert loaded.vision is None and "not in the tokenizer's vocabulary" in loaded.facts()["images"]
    ids = torch.arange(5, 40).view(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), ref(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    done, _ = reply(Session(loaded, capacity=128), messages=CHAT)
    assert done.token_ids


def test_int8_kv_serves_every_family_close_to_the_full_precision_cache(family_dir):
    """K/V held as int8 codes with a scale per position and head (a sliding-window cache's ring too): a chat
    runs, and its logits stay within the codes' error of the model-dtype cache's."""
    from engine.kv_cache import make_cache

    loaded = load_model(family_dir, device="cpu", dtype="float32")
    ids = torch.arange(5, 40).view(1, -1)
    exact, coded = (make_cache(loaded.config, 64, torch.float32, "cpu", kv) for kv in ("none", "int8"))
    want, got = loaded.model(ids, exact)[0, -1], loaded.model(ids, coded)[0, -1]
    for token in (7, 8, 9):  # decode steps read the codes back
        step = torch.tensor([[token]])
        want, got = loaded.model(step, exact)[0, -1], loaded.model(step, coded)[0, -1]
    assert float((got - want).abs().max() / want.abs().max()) < 0.05
    done, _ = reply(Session(loaded, capacity=128, kv="int8"), messages=CHAT)
    assert done.token_ids
