"""The GPU path on fake tensors (engine/tools/fake_run.py): CUDA and MPS run where no GPU is, and each kind of GPU bug
the fake device exists to catch — a CPU tensor in the decode step, a float32 buffer in a 16-bit cache, a host sync
in the decode loop — fails its check."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from engine import generation, kv_cache
from engine.config import config_from_dict
from engine.feedforward import MoE
from engine.tools.bench.shapes import tiny
from engine.tools.fake_device import FakeDeviceUnavailable, build_guards, fake_device
from engine.tools.fake_run import FAMILIES, fake_check, fake_report, memory_plan


@pytest.fixture(scope="module", autouse=True)
def guards():
    """The fake device's guard, built once; without a C++ compiler the tests skip, except in CI where they fail."""
    try:
        build_guards()
    except FakeDeviceUnavailable as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs the GPU path on fake tensors: {e}")
        pytest.skip(str(e))


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_the_gpu_path_runs_on_fake_tensors(device):
    report = fake_report(device, plans=False)
    failed = [f"{c['name']}: {c['error']}" for c in report["checks"] if not c["ok"]]
    assert failed == []
    assert report["pass"]
    names = [c["name"] for c in report["checks"]]
    assert {n.split()[0] for n in names} >= set(FAMILIES)  # every family's check ran
    greedy = next(c for c in report["checks"] if c["name"].startswith("llama") and "KV none" in c["name"])
    assert greedy["syncs_per_step"] == {"engine/sampling.py:91 in greedy_pick": 1}  # the sampled token, nothing else
    mixture = next(c for c in report["checks"] if c["name"].startswith("qwen3_moe") and "weights none" in c["name"])
    assert sum(mixture["syncs_per_step"].values()) == 1  # stacked experts: chosen on the device
    if device == "cuda":
        assert any("CaptureReached" in n for n in greedy["notes"])  # the capture path ran up to the capture
    lanes = next(c for c in report["checks"] if "lanes" in c["name"])
    assert "2" in lanes["notes"][0]  # two sequences decoded in one turn at some point


def test_the_memory_plan_counts_weights_cache_and_a_prefill():
    with fake_device("cuda", "h200", itertools.count(7)) as watch:
        plan = memory_plan(watch, "llama-3.1-8b", "cuda", "bfloat16")
    assert 14.5 * 2**30 < plan["weight_bytes"] < 15.5 * 2**30  # 8.0 B values in bfloat16
    assert plan["cache_bytes"] == 8192 * 32 * 2 * 8 * 128 * 2  # positions × layers × K,V × H_kv × d × 2 bytes
    assert 0 < plan["workspace_bytes"] < plan["cache_bytes"]
    assert plan["gpus"]["h200"]["fits"] and not plan["gpus"]["mac-16gb"]["fits"]


def test_a_cpu_tensor_in_the_decode_step_fails():
    def step(self, token):  # the token's ids made without the device
        return self.loaded.model(torch.tensor([[token]]), self.cache, last_only=True)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generation.Decoder, "step", step)
        mp.setenv("KVCHAT_CUDA_GRAPHS", "0")
        check = fake_check("cuda")
    assert not check.ok
    assert "cpu" in check.error and "engine/" in check.error  # the mismatch, with the engine's line


def test_a_float32_buffer_in_a_bfloat16_cache_fails():
    made = kv_cache.KVCache.__init__

    def init(self, *a, **k):
        made(self, *a, **k)
        self.v = self.v.float()  # one buffer left in float32

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv_cache.KVCache, "__init__", init)
        check = fake_check("cuda")
    assert not check.ok
    assert "torch.float32 in a torch.bfloat16 cache" in check.error


def test_an_item_in_the_decode_loop_fails():
    step = generation.Decoder.step

    def reads(self, token):
        logits = step(self, token)
        float(logits.float().max().item())  # a value read in every step: a second wait on the GPU
        return logits

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generation.Decoder, "step", reads)
        check = fake_check("mps")
    assert not check.ok
    assert "waits for the GPU 2 times" in check.error and "engine/generation.py" in str(check.syncs_per_step)


def test_stacked_experts_give_the_loops_output():
    """On the CPU, a mixture's decode position through stacked experts equals the one-by-one path."""
    torch.manual_seed(0)
    raw = dict(
        tiny("llama", hidden_size=64, intermediate_size=128),
        **{
            k: v
            for k, v in FAMILIES["qwen3_moe"].items()
            if k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
        },
    )
    cfg = config_from_dict(dict(raw, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe"))
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, 1, 64)
    with torch.inference_mode():
        alone = moe(x)
        many = moe(torch.cat([x, torch.randn(1, 3, 64)], dim=1))[:, :1]  # the prefill path, grouped by expert
        assert moe.stack_experts()
        stacked = moe(x)
    torch.testing.assert_close(stacked, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(many, alone, rtol=1e-5, atol=1e-5)
    assert moe.experts[1].gate_up.weight.data_ptr() == moe.stacked[0][1].data_ptr()  # a view, no second copy
