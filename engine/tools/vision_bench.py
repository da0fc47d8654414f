"""The vision encoders at their real shapes (random weights: the time does not depend on their values): the
encoder's time for one image at each family's default resolution, the prompt positions it becomes, and their K/V
bytes in the text model that reads them. `python -m engine.tools.vision_bench [--dtype bfloat16] [--json]`;
the figures go to engine/MODELS.md, "Models that see images"."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from ..devices import default_threads
from ..image_prompt import ImageFormat
from ..images import Image
from ..vision import VisionConfig
from ..vision_qwen import vision_model

# (name, vision config, the text model's KV bytes per position in 16 bits: 2·L·H_kv·d·2, a photo's size)
SHAPES = {
    "Gemma 3 4B (SigLIP so400m, 896 px)": (
        VisionConfig("gemma3", 1152, 4304, 27, 16, 896, 14, 1e-6, 2560, 262144, 256),
        2 * 34 * 4 * 256 * 2,
        {},
    ),
    "SmolVLM-256M (SigLIP base, 512 px tiles)": (
        VisionConfig("idefics3", 768, 3072, 12, 12, 512, 16, 1e-6, 576, 49190, 64, 4),
        2 * 30 * 3 * 64 * 2,
        {"size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512}},
    ),
    "Qwen2.5-VL 3B (ViT 32 layers, any size)": (
        VisionConfig(
            "qwen2_5_vl",
            1280,
            3420,
            32,
            16,
            0,
            14,
            1e-6,
            2048,
            151655,
            0,
            2,
            temporal_patch=2,
            window=112,
            full_layers=(7, 15, 23, 31),
        ),  # fmt: skip
        2 * 36 * 2 * 128 * 2,
        {"min_pixels": 3136, "max_pixels": 12845056},
    ),
}
PHOTO = (1024, 768)  # width, height: a phone photo scaled down, what the figures assume


def encoder_flops(cfg: VisionConfig, tiles: int, patches: int = 0) -> float:
    """Multiply-adds × 2 of the encoder for `tiles` tiles (Qwen2.5-VL: one image of `patches` patches): per layer
    the q/k/v/out and MLP products over its patches, and attention's two products over the patches each sees (a
    window's, or the whole tile or image); the projector's are left out (a few %)."""
    e, f = cfg.hidden_size, cfg.intermediate_size
    if cfg.family != "qwen2_5_vl":
        p = cfg.patches
        return tiles * cfg.num_layers * (2 * p * (4 * e * e + 2 * e * f) + 2 * 2 * p * p * e)
    seen = (cfg.window // cfg.patch_size) ** 2  # a window's patches
    full = len(cfg.full_layers)
    products = 2 * patches * (4 * e * e + 3 * e * f) * cfg.num_layers  # SwiGLU: three MLP products
    attention = 2 * 2 * patches * e * (full * patches + (cfg.num_layers - full) * seen)
    return products + attention


def gemm_rate(dtype: torch.dtype, n: int = 2048, runs: int = 3) -> float:
    """This machine's rate for one large product in `dtype` (FLOP/s), in the same run: the encoders' roofline."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = []
    for _ in range(runs):
        t0 = time.perf_counter()
        a @ b
        best.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(best)


def measure(name: str, dtype: torch.dtype, runs: int = 3, roof: float | None = None) -> dict:
    cfg, kv_per_position, pre = SHAPES[name]
    torch.manual_seed(0)
    model = vision_model(cfg).to(dtype).eval()
    fmt = ImageFormat(cfg, pre, lambda i: "<image>", {"boi_token_id": 1, "eoi_token_id": 2})
    photo = Image(b"", "0" * 64, PHOTO[0], PHOTO[1], "PNG")
    tiles, patches = fmt.layout(photo).tiles, 0
    if cfg.family == "qwen2_5_vl":
        gh, gw = fmt.grid(photo)
        patches = gh * gw
        pixels = (torch.randn(patches, 3 * cfg.temporal_patch * cfg.patch_size**2), (gh, gw))
        model((pixels[0][: 16 * 16], (16, 16)))  # the first call's one-time costs (allocation, threads) left out
    else:
        pixels = torch.randn(tiles, 3, cfg.image_size, cfg.image_size)
        model(pixels[:1])  # the first call's one-time costs (allocation, threads) left out
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        model(pixels)
        times.append((time.perf_counter() - t0) * 1000)
    positions = fmt.positions(photo)
    ms = statistics.median(times)
    rate = encoder_flops(cfg, tiles, patches) / (ms / 1000)
    return {
        "model": name,
        "dtype": str(dtype).removeprefix("torch."),
        "encoder_parameters": model.parameter_count(),
        "image": f"{PHOTO[0]}×{PHOTO[1]}",
        "tiles": tiles,
        "positions": positions,
        "kv_bytes": positions * kv_per_position,
        "encoder_ms": round(ms, 1),
        "encoder_gflop": round(encoder_flops(cfg, tiles, patches) / 1e9, 1),
        "gflop_s": round(rate / 1e9, 1),
        "of_gemm_roofline": round(rate / roof, 3) if roof else None,  # a 2,048³ product's rate, the same run
        "threads": torch.get_num_threads(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.tools.vision_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args(argv)
    torch.set_num_threads(default_threads())
    dtype = getattr(torch, ns.dtype)
    roof = gemm_rate(dtype)
    rows = [measure(name, dtype, ns.runs, roof) for name in SHAPES]
    if ns.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(f"{r['model']}: {r['image']} → {r['tiles']} tile(s), {r['positions']:,} positions, "
              f"{r['kv_bytes'] / 2**20:,.1f} MiB of K/V; encoder {r['encoder_ms']:,.1f} ms ({r['dtype']}, "
              f"{r['encoder_parameters'] / 1e6:,.0f} M parameters, {r['threads']} threads); {r['encoder_gflop']:,.0f} "
              f"GFLOP at {r['gflop_s']:,.1f} GFLOP/s, {100 * r['of_gemm_roofline']:.0f}% of a 2,048³ product's rate "
              f"({roof / 1e9:,.1f} GFLOP/s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
