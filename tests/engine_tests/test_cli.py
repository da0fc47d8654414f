"""The command line, run as a user runs it: exact names, JSON fields, exit codes."""

import json
import subprocess
import sys

from conversations import long_conversation, question


def run(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "engine", *map(str, args)], capture_output=True, text=True, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(r.stderr)
    return r


def test_info(llama_dir):
    out = json.loads(run("info", "--model", llama_dir, "--json", "--capacity", 100).stdout)
    assert out["architecture"] == "LlamaForCausalLM" and out["capacity"] == 100
    assert out["kv_bytes_per_position"] == 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 KV heads, d=16, float32
    assert out["kv_allocated_bytes"] == 112 * out["kv_bytes_per_position"]  # at capacity: 7 blocks of 16 positions
    assert out["kv_pool"]["block"] == 16 and out["kv_pool"]["held"] == 0  # nothing held before a request


def test_generate_json_fields(llama_dir):
    out = json.loads(run("generate", "--model", llama_dir, "--prompt", "Hello", "--max-new-tokens", 6, "--json").stdout)
    assert set(out) >= {"text", "token_ids", "prompt_token_ids", "stop_reason", "trace", "reuse", "cache"}
    assert set(out["trace"]) >= {
        "ttft_ms",
        "tpot_ms",
        "tokens",
        "decode_tok_s",
        "prefill_ms",
        "prefill_tok_s",
        "e2e_ms",
        "mean_ms_per_token_incl_wait",
    }
    assert set(out["reuse"]) >= {
        "reused",
        "computed",
        "invalidated",
        "first_invalidated_position",
        "cached_token",
        "new_token",
        "reason",
    }
    assert set(out["cache"]) >= {"positions", "capacity", "payload_bytes", "allocated_bytes"}
    n = len(out["token_ids"])
    assert out["trace"]["tokens"] == n
    if out["stop_reason"] == "max_new_tokens":
        assert out["cache"]["positions"] == len(out["prompt_token_ids"]) + n - 1
    assert out["cache"]["payload_bytes"] == out["cache"]["positions"] * 512


def test_generate_raw_and_sampling_seed_is_reproducible(llama_dir):
    """The same seed gives the same tokens at temperature 1; another seed other tokens (so the seed is used)."""

    def sample(seed):
        argv = ["generate", "--model", llama_dir, "--prompt", "Hi", "--raw", "--temperature", 1.0, "--top-k", 50]
        argv += ["--top-p", 0.9, "--min-p", 0.01, "--seed", seed, "--max-new-tokens", 8, "--json"]
        return json.loads(run(*argv).stdout)["token_ids"]

    a = sample(7)
    assert len(a) == 8 and sample(7) == a
    assert sample(8) != a


def test_generate_over_capacity_is_a_clear_error(llama_dir):
    r = run(
        "generate",
        "--model",
        llama_dir,
        "--prompt",
        "Hello there",
        "--capacity",
        30,
        "--max-new-tokens",
        50,
        check=False,
    )
    assert r.returncode == 1 and "capacity is 30" in r.stderr and "22 tokens" in r.stderr


def test_replay_shows_the_edit(llama_dir, tmp_path):
    convo = [{"role": "user", "content": "My budget is 600 yuan."}]
    steps = [
        {"messages": convo, "max_new_tokens": 5},
        {"messages": [{"role": "user", "content": "My budget is 750 yuan."}], "max_new_tokens": 5},
    ]
    script = tmp_path / "s.json"
    script.write_text(json.dumps(steps))
    lines = [
        json.loads(x) for x in run("replay", "--model", llama_dir, "--script", script, "--json").stdout.splitlines()
    ]
    assert len(lines) == 2
    r = lines[1]["reuse"]
    p0, p1 = lines[0]["prompt_token_ids"], lines[1]["prompt_token_ids"]
    diff = next(i for i, (a, b) in enumerate(zip(p0, p1)) if a != b)
    assert r["first_invalidated_position"] == diff == r["reused"]
    assert (r["cached_token"]["id"], r["new_token"]["id"]) == (p0[diff], p1[diff])  # the token that was, and is
    assert r["cached_token"]["text"].strip().startswith("6") and r["new_token"]["text"].strip().startswith("7")


def test_replay_mixes_conversations_and_reuse_follows_the_tokens(llama_dir, tmp_path):
    """Steps from two conversations, interleaved: the return to the first comes from the prefix store;
    with --cache-budget 0 it is computed again, and the replies are the same."""
    a = [{"role": "user", "content": "Plan three days in Chengdu on 600 yuan, with food and museums."}]
    b = [{"role": "user", "content": "Write a short poem about the sea at night, in four lines."}]
    steps = [{"messages": a}, {"messages": b}, {"messages": a + [{"role": "assistant", "content": "x"}]}]
    for s in steps:
        s["max_new_tokens"] = 4
    script = tmp_path / "s.json"
    script.write_text(json.dumps(steps))

    def replay(*extra):
        out = run("replay", "--model", llama_dir, "--script", script, "--json", *extra).stdout.splitlines()
        return [json.loads(x) for x in out]

    stored, cold = replay(), replay("--cache-budget", "0")
    assert [x["reuse"]["source"] for x in stored] == ["none", "working", "store"]  # b shares the template's start
    assert stored[2]["reuse"]["reused"] > len(stored[0]["prompt_token_ids"]) - 2
    assert stored[2]["reuse"]["copied_bytes"] > 0 and stored[2]["cache"]["store"]["prefixes"] == 2
    assert [x["reuse"]["source"] for x in cold] == ["none", "working", "working"]
    assert cold[2]["reuse"]["reused"] == stored[1]["reuse"]["reused"]  # only the template's start
    assert [x["token_ids"] for x in stored] == [x["token_ids"] for x in cold]
    r = run("replay", "--model", llama_dir, "--script", script, "--cache-budget", "lots", check=False)
    assert r.returncode == 2 and "not a size" in r.stderr


def test_a_step_that_is_not_valid_unicode_fails_alone(llama_dir, tmp_path):
    """A lone surrogate (JSON allows "\\ud800") is a clear error for that step; the other steps run."""
    steps = [
        {"messages": [{"role": "user", "content": "fine"}], "max_new_tokens": 3},
        {"messages": [{"role": "user", "content": "bad \ud800 text"}], "max_new_tokens": 3},
        {"prompt": "also fine", "max_new_tokens": 3},
    ]
    script = tmp_path / "s.json"
    script.write_text(json.dumps(steps))  # json writes the surrogate as the escape \ud800
    r = run("replay", "--model", llama_dir, "--script", script, "--json", check=False)
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [("error" in x) for x in lines] == [False, True, False] and r.returncode == 1
    assert "'\\ud800', which is not valid Unicode" in lines[1]["error"] and "Traceback" not in r.stderr


def test_chat_edit_and_stats(llama_dir):
    r = subprocess.run(
        [sys.executable, "-m", "engine", "chat", "--model", str(llama_dir), "--max-new-tokens", "4"],
        input="My budget is 600 yuan.\n/edit 1 My budget is 750 yuan.\n/stats\n/quit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "invalidated" in r.stdout and "from position" in r.stdout and '"positions"' in r.stdout


def test_bench_json(llama_dir):
    out = json.loads(
        run(
            "bench",
            "--model",
            llama_dir,
            "--prompt-tokens",
            32,
            "--new-tokens",
            8,
            "--uncached-tokens",
            3,
            "--engines",
            "kvchat,kvchat-no-kernels,kvchat-uncached,transformers-static",
            "--precisions",
            "float32,int8",
            "--json",
        ).stdout
    )
    rows = {(r["engine"], r["precision"]): r for r in out["results"]}
    assert set(rows) == {
        ("kvchat", "float32"),
        ("kvchat", "int8"),
        ("kvchat-no-kernels", "float32"),
        ("kvchat-no-kernels", "int8"),
        ("kvchat-uncached", "float32"),
        ("transformers-static", "float32"),
    }
    for r in rows.values():
        assert "error" not in r, r
        assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["peak_mem_bytes"] > 0
        roof = out["bandwidth_gb_s"] * 1e9 / r["bytes_per_token"]  # read bandwidth / bytes read per token
        assert abs(r["roofline_tok_s"] - roof) < 0.01 * roof and r["roofline_pct"] > 0
    assert out["copy_bandwidth_gb_s"] > 0  # reported beside the read roofline
    k = rows[("kvchat", "float32")]
    assert k["tokens"] == 8 and k["weights"] == "none" and rows[("kvchat", "int8")]["weights"] == "int8/per-channel"
    assert k["same_tokens_as_kvchat"] == 8
    assert k["load_vs_file_read"] > 0 and k["peak_above_baseline_vs_weights_kv"] > 0
    assert out["ratios"]["kvchat float32 / transformers-static float32"]["decode"] > 0
    assert out["ratios"]["kvchat float32 / kvchat-uncached float32"]["decode"] > 0
    assert (
        "no kvchat kernels: RuntimeError: turned off by KVCHAT_KERNELS"
        in rows[("kvchat-no-kernels", "int8")]["decode_kernels"]
    )
    assert out["ratios"]["kvchat-no-kernels int8 / kvchat-no-kernels float32"]["decode"] > 0
    from engine.backends import kernels

    assert out["cpu"]["model"] and out["cpu"]["kernels"] == kernels.status()  # what this process's kernels are


def test_the_speculative_bench_runs_each_target_precision_asked(demo_model_dir, llama_dir):
    """`bench --speculative lookup --precisions float32,int8/a8`: each task's rows for each target, the model alone
    and lookup, the drafted tokens the model's own; a precision the model cannot run as is refused with those it
    can."""
    args = ("bench", "--speculative", "lookup", "--model", demo_model_dir, "--new-tokens", 8, "--rounds", 1)
    out = json.loads(run(*args, "--precisions", "float32,int8/a8", "--json").stdout)
    got = {(r["target"], r["task"], r["draft"]): r for r in out["rows"]}
    assert set(got) == {(t, task, d) for t in ("float32", "int8/a8") for task in ("text", "edit", "rewrite")
                        for d in ("none", "lookup")}  # fmt: skip
    for (_, _, draft), r in got.items():
        assert "error" not in r and r["decode_tok_s"] > 0, r
        assert draft == "none" or r["same_tokens"]
    refused = subprocess.run([sys.executable, "-m", "engine", *map(str, args), "--precisions", "file/a8"],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert refused.returncode != 0 and "--precisions file/a8" in refused.stderr and "int4/a8" in refused.stderr
    small = json.loads(run(*args[:4], llama_dir, *args[5:], "--json").stdout)  # 256 positions: the text task fits
    rows = {(r["task"], r["draft"]): r for r in small["rows"]}
    assert len(rows) == 6 and rows["text", "lookup"]["decode_tok_s"] > 0
    for task, draft in (("edit", "none"), ("edit", "lookup"), ("rewrite", "none"), ("rewrite", "lookup")):
        assert "KV cache holds only 256 positions" in rows[task, draft]["error"]


def test_bench_roofline_arithmetic():
    from engine.tools.bench.roofline import bytes_per_token, roofline_tok_s

    # the figure: 20 GB/s over 0.54 GB of float32 weights caps decode near 37 tok/s
    assert round(roofline_tok_s(20e9, bytes_per_token(540_000_000, 113_246_208, True, 0, 0))) == 37
    # an untied embedding gives one row per token: not counted; the K/V of the context are
    assert bytes_per_token(1000, 200, False, 10, 50) == 1000 - 200 + 500


def test_quality_compares_quantized_with_full_precision(llama_dir):
    out = json.loads(
        run(
            "quality",
            "--model",
            llama_dir,
            "--weights",
            "int4",
            "--kv",
            "int8",
            "--group-size",
            16,
            "--new-tokens",
            8,
            "--json",
        ).stdout
    )
    assert out["weights"] == "int4/g16" and out["kv"] == "int8"
    assert 0 <= out["top1_agreement"] <= 1 and out["positions"] > 0 and out["mean_kl"] >= 0
    assert out["weight_bytes_quant"] < out["weight_bytes_full"]
    assert out["kv_bytes_per_position_quant"] == 2 * 2 * 2 * (16 + 4)  # int8 codes + a float32 scale per head
    assert out["kv_bytes_per_position_full"] == 2 * 2 * 2 * 16 * 4
    assert out["perplexity_full"] > 1 and out["perplexity_quant"] > 1
    same = json.loads(run("quality", "--model", llama_dir, "--new-tokens", 8, "--json").stdout)
    assert same["top1_agreement"] == 1.0 and same["mean_kl"] == 0 and same["prompts_diverged"] == 0
    assert same["prompt_top1_agreement"] == 1.0 and same["prompt_mean_kl"] == 0  # the prompt's positions too
    assert 0 < out["prompt_top1_agreement"] <= 1 and out["prompt_mean_kl"] > 0 and out["prompt_positions"] > 1


def test_generate_with_quantized_weights_and_cache(llama_dir):
    out = json.loads(
        run(
            "generate",
            "--model",
            llama_dir,
            "--prompt",
            "Hello",
            "--max-new-tokens",
            4,
            "--weights",
            "int8",
            "--kv",
            "int4",
            "--json",
        ).stdout
    )
    per = 2 * 2 * 2 * (16 // 2 + 4)
    assert out["cache"]["payload_bytes"] == out["cache"]["positions"] * per


def test_selftest_checks_on_this_machine():
    out = json.loads(run("selftest", "--no-bench", "--json").stdout)
    assert out["pass"] and out["device"] in ("cpu", "cuda")
    cached = [c for c in out["checks"] if "agree" in c]
    assert {c["dtype"] for c in cached} >= {"float32", "bfloat16"}
    assert all(c["agree"] == c["tokens"] for c in cached if c["dtype"] == "float32")
    parity = [c for c in out["checks"] if "max_abs_logit_diff" in c]
    assert parity and all(c["max_abs_logit_diff"] < 1e-3 for c in parity)


def test_a_bench_row_that_crashes_or_hangs_is_a_row_with_its_error():
    """A reference engine that dies in native code (llama.cpp's general protection fault on one CPU) or
    never returns must not hang the benchmark: its row says what happened and the run goes on."""
    import operator
    import os
    import time

    from engine.tools.bench.isolation import run_isolated

    assert run_isolated(operator.add, (2, 3), timeout=60) == 5
    crashed = run_isolated(os.abort, (), timeout=60)
    assert crashed == {"error": "the child process died (signal SIGABRT)"}
    t0 = time.monotonic()
    hung = run_isolated(time.sleep, (600,), timeout=2)
    assert hung == {"error": "timed out after 2 s: stopped"} and time.monotonic() - t0 < 30
    raised = run_isolated(operator.truediv, (1, 0), timeout=60)
    assert raised == {"error": "ZeroDivisionError: division by zero"}


def test_bench_says_which_cpu_it_ran_on():
    from engine.backends import kernels
    from engine.tools.bench.machine import cpu_info
    from engine.tools.bench.report import markdown

    cpu = cpu_info()
    assert cpu["model"] and cpu["kernels"] == kernels.status()
    flags = open("/proc/cpuinfo").read()
    assert ("avx2" in cpu["instruction_sets"]) == (" avx2" in flags)
    report = {"cpu": cpu, "results": [], "ratios": {}}
    assert markdown(report).startswith(f"CPU: {cpu['model']}")


def test_overflow_policies_on_the_command_line(tmp_path):
    """--overflow on generate, replay and chat: a conversation past the capacity is answered with turns left
    out and the report says which; stop (the default) refuses it as before; a step may name its own policy."""
    msgs = long_conversation(8)
    steps = [{"messages": msgs, "max_new_tokens": 8}, {"messages": msgs, "max_new_tokens": 8, "overflow": "stop"}]
    script = tmp_path / "s.json"
    script.write_text(json.dumps(steps))
    r = run("replay", "--script", script, "--capacity", 160, "--overflow", "drop-oldest", "--json", check=False)
    first, second = (json.loads(x) for x in r.stdout.splitlines())
    assert r.returncode == 1 and "error" not in first and "capacity" in second["error"]
    d = first["reuse"]
    assert d["overflow"] == "drop-oldest" and d["dropped_messages"][0] == 1 and d["dropped_positions"] > 0
    assert len(first["prompt_token_ids"]) + 8 - 1 <= 160
    text = run("replay", "--script", script, "--capacity", 160, "--overflow", "truncate-middle", check=False).stdout
    assert "left out to fit the cache (truncate-middle): messages 4, 5" in text  # the first turn (2, 3) stays

    long = " ".join(f"word{i}" for i in range(300))
    g = run("generate", "--prompt", long, "--raw", "--capacity", 64, "--max-new-tokens", 8, "--json",
            "--overflow", "truncate-middle")  # fmt: skip
    out = json.loads(g.stdout)
    assert len(out["prompt_token_ids"]) == 64 - 8 + 1 and out["reuse"]["dropped_positions"] > 0
    refused = run("generate", "--prompt", long, "--raw", "--capacity", 64, "--max-new-tokens", 8, check=False)
    assert refused.returncode == 1 and "capacity" in refused.stderr

    chat = subprocess.run(
        [sys.executable, "-m", "engine", "chat", "--capacity", "96", "--max-new-tokens", "8", "--overflow",
         "drop-oldest"],
        input="\n".join(question(i)["content"] for i in range(6)) + "\n",
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert chat.returncode == 0 and "left out to fit the cache (drop-oldest): messages 1, 2" in chat.stdout


def test_a_size_too_big_to_be_a_disk_is_a_usage_error_not_a_traceback(llama_dir):
    r = run("generate", "--model", llama_dir, "--prompt", "Hi", "--disk-budget", "9" * 400, check=False)
    assert r.returncode == 2 and "not a size this machine can hold" in r.stderr and "Traceback" not in r.stderr


def test_generate_with_drafts_says_them_and_reports_them_in_the_json(llama_dir):
    """`generate --speculative lookup`: the JSON's trace holds the drafting's counts, and the plain run prints the
    drafts' line after the reply; the tokens are the model's own."""
    args = ["generate", "--model", llama_dir, "--prompt", "the cache the cache the cache the cache", "--raw",
            "--max-new-tokens", 24]  # fmt: skip
    plain = json.loads(run(*args, "--json").stdout)
    drafted = json.loads(run(*args, "--json", "--speculative", "lookup", "--draft-tokens", 3).stdout)
    spec = drafted["trace"]["speculative"]
    assert drafted["token_ids"] == plain["token_ids"] and plain["trace"]["speculative"] is None
    assert spec["draft"] == "lookup" and spec["k"] == 3 and spec["drafted"] >= spec["accepted"] >= 0
    said = run(*args, "--speculative", "lookup").stderr
    assert "drafts (n-gram lookup in the conversation): " in said
