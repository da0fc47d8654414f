"""`python -m engine.tools.moe_bench`: gpt-oss's shape scaled down (its widths, heads and 32 experts of which 4 run,
fewer layers and a smaller vocabulary), random weights with the experts in MXFP4 as released, decoded by kvchat (the
folder) and by llama.cpp (the same weights as its GGUF: experts MXFP4, the rest BF16) in the same run, each in a
child process of its own. Reported: decode tok/s, kvchat ÷ llama.cpp, and each one's share of the read roofline for
the bytes one token reads (every weight but the embedding table, and of the experts only the 4 of 32 it is routed
to), the roofline a read stream's bandwidth measured in the same run (engine/BENCHMARKS.md, "gpt-oss in MXFP4")."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

SHAPE = {  # gpt-oss-20b's widths (hidden 2880, 64 query heads and 8 K/V heads of 64, experts 2880 wide, 4 of 32)
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "attention_bias": True,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
    },  # fmt: skip
}


def write_folder(out: Path, layers: int, vocab: int, seed: int = 0) -> Path:
    """The scaled-down shape as a released gpt-oss folder: float tensors at random (std 0.02), the experts as
    random MXFP4 codes with scales around 2^-8 (values of about that spread), never a float copy of them."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ..config import config_from_dict
    from ..weights.hf_names import expected

    raw = dict(SHAPE, num_hidden_layers=layers, vocab_size=vocab, torch_dtype="bfloat16")
    cfg = config_from_dict(raw)
    g = torch.Generator().manual_seed(seed)
    E, D, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    out.mkdir(parents=True, exist_ok=True)
    index = {}
    for i in range(-1, layers):
        tensors = {}
        for name, shape in expected(cfg).items():
            mine = name.startswith(f"model.layers.{i}.") if i >= 0 else not name.startswith("model.layers.")
            if mine and ".experts." not in name:
                t = torch.randn(shape, generator=g) * 0.02
                tensors[name] = (t + 1 if name.endswith("norm.weight") else t).to(torch.bfloat16)
        if i >= 0:
            p = f"model.layers.{i}.mlp.experts."
            for base, (rows, cols) in (("gate_up_proj", (2 * F, D)), ("down_proj", (D, F))):
                tensors[p + base + "_blocks"] = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g,
                                                              dtype=torch.uint8)  # fmt: skip
                tensors[p + base + "_scales"] = torch.randint(119, 122, (E, rows, cols // 32), generator=g,
                                                              dtype=torch.uint8)  # fmt: skip
                tensors[p + base + "_bias"] = (torch.randn(E, rows, generator=g) * 0.02).to(torch.bfloat16)
        shard = f"model-{i + 1:05d}.safetensors"
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, shard))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(raw))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    return out


def kvchat_row(folder: str, prompt: list[int], new: int, threads: int, activations: str = "float32") -> dict:
    """kvchat's decode on the folder (bfloat16, its experts' own MXFP4 codes, multiplied by `activations`): tok/s
    after the first token, and the bytes a token reads."""
    import torch

    from ..session import Request, Session
    from ..weights.loading import load_model

    torch.set_num_threads(threads)
    loaded = load_model(folder, dtype="bfloat16", activations=activations)
    session = Session(loaded, capacity=len(prompt) + new + 8)
    req = Request(prompt_ids=tuple(prompt), max_new_tokens=new, ignore_eos=True)
    list(session.generate(Request(prompt_ids=tuple(prompt[:8]), max_new_tokens=4, ignore_eos=True)))  # warm
    fin = list(session.generate(req))[-1]
    times = fin.trace["token_times"] if isinstance(fin.trace, dict) and "token_times" in fin.trace else None
    model, cfg = loaded.model, loaded.config
    experts = sum(sum(e.gate_up.storage_bytes + e.down.storage_bytes + _bias_bytes(e) for e in b.mlp.experts)
                  for b in model.layers)  # fmt: skip
    everything = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    embed = model.embed.weight.numel() * model.embed.weight.element_size()
    per_token = everything - embed - experts + experts * cfg.experts_per_token / cfg.num_experts
    return {"tok_s": fin.trace["decode_tok_s"], "bytes_per_token": per_token, "times": times,
            "held": loaded.quantization, "tokens": list(fin.token_ids),
            "step": "the one-call C step" if model.decode_step is not None else
                    f"the modules, layer by layer ({model.decode_step_refused or 'no C step for it'})"}  # fmt: skip


def _bias_bytes(expert) -> int:
    return sum(t.numel() * t.element_size() for t in (expert.gate_up.bias, expert.down.bias) if t is not None)


def llama_row(gguf: str, prompt: list[int], new: int, threads: int) -> dict:
    """llama.cpp's decode on the GGUF (repacking off: its repacked mixture products crash in llama-cpp-python
    0.3.36, engine/BENCHMARKS.md "A mixture of experts"): tok/s after the first token, the bytes a token reads."""
    from .bench.roofline import gguf_tensor_bytes
    from .llamacpp import LlamaCpp

    lc = LlamaCpp(Path(gguf), n_ctx=len(prompt) + new + 8, threads=threads, repack=False)
    lc.generate(prompt[:8], 4)
    ids, _, times = lc.generate(prompt, new)
    lc.close()
    total, embed, active = gguf_tensor_bytes(Path(gguf))
    rate = (len(times) - 1) / (times[-1] - times[0])  # as kvchat's trace counts it: the tokens after the first
    return {"tok_s": rate, "bytes_per_token": active - embed, "tokens": ids}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.tools.moe_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="each engine's runs, alternating (medians reported)")
    p.add_argument("--activations", default="float32,int8", help="kvchat's rows: what its products multiply")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    import torch

    from ..devices import default_threads
    from .bench.isolation import run_isolated
    from .bench.machine import measure_read_bandwidth
    from .bench.shapes import random_prompt
    from .gguf_export import write_gguf

    threads = default_threads()
    torch.set_num_threads(threads)
    kinds = [a.strip() for a in ns.activations.split(",") if a.strip()]
    rows: dict[str, list[dict]] = {**{f"kvchat {a}": [] for a in kinds}, "llama.cpp": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(Path(tmp) / "gpt-oss-small", ns.layers, ns.vocab)
        gguf = write_gguf(folder, Path(tmp) / "gpt-oss-small.gguf", matrices="BF16", tokenizer=False)
        prompt = random_prompt(ns.prompt_tokens, ns.vocab)
        bandwidth = measure_read_bandwidth()
        for _ in range(ns.rounds):
            for a in kinds:
                rows[f"kvchat {a}"].append(run_isolated(kvchat_row, (str(folder), prompt, ns.new_tokens, threads, a)))
            rows["llama.cpp"].append(run_isolated(llama_row, (str(gguf), prompt, ns.new_tokens, threads)))
    report = {"shape": {**SHAPE, "num_hidden_layers": ns.layers, "vocab_size": ns.vocab}, "threads": threads,
              "read_bandwidth_gb_s": bandwidth / 1e9, "rows": {}}  # fmt: skip
    for name, runs in rows.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            report["rows"][name] = {"error": runs[0]["error"]}
            continue
        rate = statistics.median(r["tok_s"] for r in ok)
        per = ok[0]["bytes_per_token"]
        report["rows"][name] = {"decode_tok_s": round(rate, 2), "bytes_per_token": per,
                                "roofline_share": round(rate * per / bandwidth, 3), "runs": [r["tok_s"] for r in ok],
                                **{k: ok[0][k] for k in ("held", "step") if k in ok[0]}}  # fmt: skip
    lc = report["rows"]["llama.cpp"]
    for a in kinds:
        k = report["rows"][f"kvchat {a}"]
        if "decode_tok_s" in k and "decode_tok_s" in lc:
            k["over_llama_cpp"] = round(k["decode_tok_s"] / lc["decode_tok_s"], 3)
            k["same_greedy_tokens"] = rows[f"kvchat {a}"][0].get("tokens") == rows["llama.cpp"][0].get("tokens")
    if ns.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"gpt-oss shape, {ns.layers} layers, vocab {ns.vocab:,}, {threads} threads; read stream "
          f"{report['read_bandwidth_gb_s']:.1f} GB/s")  # fmt: skip
    for name, r in report["rows"].items():
        if "error" in r:
            print(f"  {name:10s} error: {r['error']}")
        else:
            runs = ", ".join(f"{x:.2f}" for x in r["runs"])
            ratio = f"  {r['over_llama_cpp']:.2f}× llama.cpp" if "over_llama_cpp" in r else ""
            print(f"  {name:15s} {r['decode_tok_s']:7.2f} tok/s  {r['bytes_per_token'] / 2**20:7.1f} MiB a token  "
                  f"{100 * r['roofline_share']:5.1f}% of the read roofline{ratio}  (runs {runs})")  # fmt: skip
            if "step" in r:
                print(f"  {'':15s} decoded by {r['step']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
