"""gpt-oss: its stacked, biased experts read as kvchat's own (float, and the MXFP4 blocks it is released in), sinks,
alternating windows and yarn against transformers, and its checkpoints' shapes checked before anything is built.
(The float form's logits against transformers for the prompt and 20 cached steps: test_parity's gpt_oss cases.)"""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import FAMILY_CASES, make_checkpoint
from engine.errors import ModelLoadError
from engine.kv_cache import KVCache
from engine.quant import MXFP4_CODES, integer_product, mxfp4_scales, unpack_mxfp4
from engine.weights.loading import load_model
from engine.weights.stacked_experts import dequantize_mxfp4

transformers = pytest.importorskip("transformers")


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, in] -> (blocks [n, in/32, 16] uint8, scales [n, in/32] uint8): each block of 32 scaled by a power of
    two that brings its largest value within e2m1's ±6, each value its nearest code (low nibble first)."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    top = blocks.abs().amax(-1).clamp_min(1e-30)  # [n, in/32]
    exp = torch.ceil(torch.log2(top / 6.0)).to(torch.int32)
    grid = torch.tensor(MXFP4_CODES) / 2  # the e2m1 values
    codes = (blocks / torch.exp2(exp.float())[..., None]).unsqueeze(-1).sub(grid).abs().argmin(-1)
    codes = codes.to(torch.uint8).reshape(n, k // 32, 16, 2)  # [n, in/32, 16, 2]: even, odd
    return codes[..., 0] | (codes[..., 1] << 4), (exp + 127).to(torch.uint8)


def _as_mxfp4(float_dir, mxfp4_dir) -> None:
    """The float checkpoint's experts rounded to MXFP4: `mxfp4_dir` holds their blocks and scales, `float_dir` is
    rewritten with the rounded values (so transformers computes what the codes hold)."""
    shutil.copytree(float_dir, mxfp4_dir)
    tensors = load_file(float_dir / "model.safetensors")
    coded = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors[name]  # [E, in, out]
        per_out = w.transpose(1, 2).contiguous()  # [E, out, in]
        blocks, scales = zip(*(_mxfp4(per_out[e]) for e in range(w.shape[0])))
        blocks, scales = torch.stack(blocks), torch.stack(scales)
        rounded = torch.stack([dequantize_mxfp4(b, s) for b, s in zip(blocks, scales)])  # [E, out, in]
        tensors[name] = rounded.transpose(1, 2).contiguous()
        del coded[name]
        coded[name + "_blocks"], coded[name + "_scales"] = blocks, scales
    save_file(tensors, float_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(coded, mxfp4_dir / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((mxfp4_dir / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mxfp4_dir / "config.json").write_text(json.dumps(raw))


def _logits(loaded, prompt: torch.Tensor, steps: int = 20) -> list[torch.Tensor]:
    """The prompt's logits, then each of `steps` greedy cached decode steps' logits."""
    cfg = loaded.config
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, torch.float32, "cpu")
    with torch.no_grad():
        out = [loaded.model(prompt, cache)]
        for _ in range(steps):
            out.append(loaded.model(out[-1][:, -1:].argmax(-1), cache))
    return out


@pytest.mark.parametrize("n", [2880, 160, 128, 96, 32])
def test_the_mxfp4_product_is_the_values_it_codes_for_float32_and_bfloat16_activations(n, kernel_variant):
    """One row's MXFP4 product (gpt-oss's experts in decode) equals the float64 product of the values its codes and
    e8m0 scales hold, within float32 rounding of the terms: for float32 x, and for x that is bfloat16 (a bfloat16
    model's activations, which AVX-512 BF16 multiplies as bfloat16 pairs) — whole steps of 4 blocks and the
    blocks past them, scales from the subnormal 2^-128 up; with int8 activations, the integer product's
    definition."""
    if "mxfp4" not in kernel_variant.modes:
        pytest.skip(f"no MXFP4 products in the {kernel_variant.variant} build")
    g = torch.Generator().manual_seed(n)
    out = 37
    codes = torch.randint(0, 256, (out, n // 2), generator=g, dtype=torch.uint8)
    e = torch.randint(112, 136, (out, n // 32), generator=g, dtype=torch.uint8)
    e[0, 0], e[1, -1], e[2, 0] = 0, 1, 2
    values = unpack_mxfp4(codes).double() * mxfp4_scales(e).double().repeat_interleave(32, dim=1)  # [out, n]
    for x in (torch.randn(n, generator=g), torch.randn(n, generator=g).bfloat16().float()):
        got = kernel_variant.qmatvec("mxfp4", codes, e, x, 32).double()
        want, size = values @ x.double(), values.abs() @ x.double().abs()
        assert float(((got - want).abs() / size.clamp_min(1e-300)).max()) < 1e-6, kernel_variant.variant
        # int8 activations: x quantized per block of 32, the blocks' integer sums (engine.quant.integer_product)
        got = kernel_variant.qmatvec("mxfp4", codes, e, x, 32, activations="int8").double()
        want = integer_product(unpack_mxfp4(codes), mxfp4_scales(e), x)
        assert float(((got - want).abs() / size.clamp_min(1e-300)).max()) < 1e-5, kernel_variant.variant


def test_the_mxfp4_blocks_compute_as_the_values_they_code(tmp_path, kernel_variant):
    """The released form (experts as MXFP4 blocks and e8m0 scales) runs on its own codes where the kernels read
    them (every variant: held at half a byte a value) and gives the logits of the float form of the values those
    codes hold (within 1e-5 of the largest), both equal to transformers' within 1e-4 through 20 cached steps; the
    values themselves were rounded (the codes are not the float weights)."""
    opts = dict(FAMILY_CASES["gpt_oss"], swiglu_limit=0.4)  # a limit the tiny model's activations reach
    float_dir = make_checkpoint(tmp_path / "float", opts.pop("family"), **opts)
    before = load_file(float_dir / "model.safetensors")["model.layers.0.mlp.experts.gate_up_proj"]
    _as_mxfp4(float_dir, tmp_path / "mxfp4")
    after = load_file(float_dir / "model.safetensors")["model.layers.0.mlp.experts.gate_up_proj"]
    assert not torch.equal(before, after) and float((before - after).abs().max()) < 0.1
    coded, plain = load_model(tmp_path / "mxfp4", dtype="float32"), load_model(float_dir, dtype="float32")
    prompt = torch.arange(5, 17)[None]
    expert = coded.model.layers[0].mlp.experts[1].down
    if coded.kernels is not None and "mxfp4" in coded.kernels.modes:
        assert expert.mode == "mxfp4" and expert.codes.dtype == torch.uint8
        assert expert.storage_bytes == 64 * 32 // 2 + 64  # half a byte a value, an e8m0 byte a block
        assert "experts the file's MXFP4, held as mxfp4" in coded.quantization
    else:  # no kernel reads MXFP4 here: the same values as int8 codes
        assert expert.mode == "int8"
    mine, theirs = _logits(coded, prompt), _logits(plain, prompt)
    for a, b in zip(mine, theirs):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
    ref = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    ids = prompt
    with torch.no_grad():
        torch.testing.assert_close(mine[0], ref(ids).logits, rtol=1e-4, atol=1e-4)
        for k, step in enumerate(mine[1:]):
            ids = torch.cat([ids, mine[k][:, -1:].argmax(-1).view(1, 1)], dim=1)
            torch.testing.assert_close(step[:, -1], ref(ids).logits[:, -1], rtol=1e-4, atol=1e-4)


def test_its_config_reads_as_the_family_is_built(tmp_path):
    """Every other layer slides (the first does), sinks and yarn are said in the cache's words, and the one-call C
    step computes the family (sinks, a window per layer, the router's bias and top k, the experts' biases and clamp)
    and agreed with the module path at load."""
    opts = dict(FAMILY_CASES["gpt_oss"], num_hidden_layers=4)
    loaded = load_model(make_checkpoint(tmp_path, opts.pop("family"), **opts), dtype="float32")
    cfg = loaded.config
    assert cfg.windows == (6, None, 6, None) and cfg.sinks and cfg.experts_per_token == 2
    assert "attention sinks" in cfg.describe_attention() and "window 6 on 2 of 4 layers" in cfg.describe_attention()
    assert cfg.rope.type == "yarn" and "yarn ramp 1–32 turns (untruncated)" in cfg.rope.describe()
    assert abs(cfg.rope.attention_factor - (0.1 * torch.log(torch.tensor(4.0)).item() + 1)) < 1e-9
    assert not cfg.plain_blocks and cfg.step_blocks
    assert loaded.model.decode_step is not None and loaded.model.decode_step_refused is None


def test_the_step_check_compares_products_under_the_module_paths_choice_of_experts(tmp_path, monkeypatch):
    """Where the module path routes a position to other experts than the step would (two roundings of a near-tie,
    played here by a module path that sends each position's last expert to its lowest-scored one), the load-time
    check gives the step the module path's choice and passes what computes alike; a step that computes otherwise
    is still refused."""
    from engine.backends import decode_step
    from engine.feedforward import MoE

    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))  # no kept pass: the check runs
    opts = dict(FAMILY_CASES["gpt_oss"], num_hidden_layers=2)
    folder = make_checkpoint(tmp_path / "model", opts.pop("family"), **opts)

    def elsewhere(self, x):  # gpt-oss's routing (the k's softmax over their logits), its last expert the worst
        logits = self.router(x)  # [N, E]
        chosen = logits.topk(self.k, dim=-1).indices.clone()
        chosen[:, -1] = logits.argmin(-1)
        return torch.softmax(logits.gather(1, chosen), dim=-1).to(x.dtype), chosen

    monkeypatch.setattr(MoE, "route", elsewhere)
    loaded = load_model(folder, dtype="float32")
    if loaded.kernels is None:
        pytest.skip("no kernels here: the module path serves every model")
    assert loaded.model.decode_step is not None and loaded.model.decode_step_refused is None
    real = decode_step.DecodeLayers.run
    monkeypatch.setattr(decode_step.DecodeLayers, "run", lambda self, x, *a: real(self, x, *a) or x.add_(x.roll(1)))
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "other"))  # another build: the pass above is not its
    wrong = load_model(folder, dtype="float32")
    assert wrong.model.decode_step is None and "disagreed" in wrong.model.decode_step_refused


@pytest.mark.parametrize(
    "tensor,shape,said",
    [
        ("model.layers.1.mlp.experts.gate_up_proj", [4, 64, 48], "gate_up_proj' has shape [4, 64, 48]"),
        ("model.layers.0.mlp.experts.down_proj_bias", [3, 64], "down_proj_bias' has shape [3, 64]"),
    ],
)
def test_a_stacked_tensor_the_config_does_not_bear_out_is_refused_by_name(tmp_path, tensor, shape, said):
    opts = dict(FAMILY_CASES["gpt_oss"])
    path = make_checkpoint(tmp_path, opts.pop("family"), **opts)
    tensors = load_file(path / "model.safetensors")
    tensors[tensor] = torch.zeros(shape)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=re.escape(said)):
        load_model(path, dtype="float32")


def test_missing_scales_are_refused_by_name(tmp_path):
    opts = dict(FAMILY_CASES["gpt_oss"])
    float_dir = make_checkpoint(tmp_path / "float", opts.pop("family"), **opts)
    _as_mxfp4(float_dir, tmp_path / "mxfp4")
    tensors = load_file(tmp_path / "mxfp4" / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="down_proj_scales' is missing"):
        load_model(tmp_path / "mxfp4", dtype="float32")


def test_the_gguf_form_in_mxfp4_reads_as_the_folder_and_llama_cpp_agrees(tmp_path):
    """Written as llama.cpp's converter writes the released checkpoint (the experts in llama.cpp's MXFP4 blocks, the
    rest float): kvchat's logits equal the MXFP4 folder's bit for bit, and llama.cpp's greedy tokens on that file
    equal kvchat's (where llama-cpp-python is installed)."""
    from gguf import GGUFReader

    from engine.session import Request, Session
    from engine.tools.gguf_export import write_gguf

    opts = dict(FAMILY_CASES["gpt_oss"])
    float_dir = make_checkpoint(tmp_path / "float", opts.pop("family"), **opts)
    _as_mxfp4(float_dir, tmp_path / "mxfp4")
    path = write_gguf(tmp_path / "mxfp4", tmp_path / "m.gguf", tokenizer=True)
    kinds = {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    assert kinds["blk.0.ffn_gate_exps.weight"] == kinds["blk.1.ffn_down_exps.weight"] == "MXFP4"
    assert kinds["blk.0.attn_sinks.weight"] == kinds["blk.0.ffn_gate_exps.bias"] == "F32"
    gguf, folder = load_model(path, dtype="float32"), load_model(tmp_path / "mxfp4", dtype="float32")
    assert gguf.config.windows == folder.config.windows and gguf.config.rope == folder.config.rope
    prompt = torch.arange(5, 17)[None]
    for a, b in zip(_logits(gguf, prompt), _logits(folder, prompt)):
        assert torch.equal(a, b)
    ids = list(range(5, 45))  # longer than the window
    done = list(
        Session(gguf, capacity=128).generate(Request(prompt_ids=tuple(ids), max_new_tokens=16, ignore_eos=True))
    )
    pytest.importorskip("llama_cpp")
    from engine.tools.llamacpp import LlamaCpp

    lc = LlamaCpp(path, n_ctx=128, threads=1)
    theirs, _, _ = lc.generate(ids, 16)
    lc.close()
    assert theirs == list(done[-1].token_ids)


@pytest.mark.parametrize("form", ["float", "mxfp4", "mxfp4-int8-activations"])
def test_the_one_call_step_decodes_as_the_modules_and_batches_each_as_alone(tmp_path, form, kernel_variant):
    """gpt-oss on the one-call C step (its sinks, a window on every other layer, the router's bias and top k, the
    experts' biases and clamp, MXFP4 experts on their own products): each decode step within rounding of the
    module path's, past the window; and several sequences' steps in one call (the scheduler's batched step) each
    equal to its own step bit for bit, at different lengths, on every variant this CPU runs."""
    opts = dict(FAMILY_CASES["gpt_oss"], num_hidden_layers=4)
    path = make_checkpoint(tmp_path / "float", opts.pop("family"), **opts)
    if form != "float":
        _as_mxfp4(path, tmp_path / "mxfp4")
        path = tmp_path / "mxfp4"
    loaded = load_model(path, dtype="float32", activations="int8" if form.endswith("activations") else "float32")
    cfg, model = loaded.config, loaded.model
    assert model.decode_step is not None and model.decode_step_refused is None
    if form != "float":
        assert model.layers[0].mlp.experts[0].gate_up.mode == "mxfp4"

    def caches(n):
        made = [KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 48, torch.float32, "cpu") for _ in range(n)]
        for i, c in enumerate(made):
            model(torch.arange(3, 8 + 3 * i)[None] % cfg.vocab_size, c)  # 5.. positions: some past the window of 6
        return made

    with torch.inference_mode():
        fast, slow = caches(1)[0], caches(1)[0]
        kept = model.decode_step
        for t in range(12):
            token = torch.tensor([[7 + t]])
            got = model(token, fast, last_only=True)
            model.decode_step = None
            want = model(token, slow, last_only=True)
            model.decode_step = kept
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if not model.decode_step.batches:
            return
        alone, together = caches(5), caches(5)
        for step in range(3):
            for n in (5, 2, 3):
                tokens = [(11 * i + step + n) % cfg.vocab_size for i in range(n)]
                want = [model(torch.tensor([[t]]), c, last_only=True) for t, c in zip(tokens, alone[:n])]
                got = model.forward_many(tokens, together[:n])
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (step, n)
