"""Image input throughput (issue 33): requests that each carry one image, against the same number of requests of
the same lengths in text alone, through `LLM.generate`; and the vision tower's time per image.

The workload: `--num-prompts` requests (256), each `--text-len` random text tokens around one
`--image-size`-square image (448 x 448: a 32 x 32 patch grid, 256 image tokens after the 2 x 2 merge on
Qwen2.5-VL) and `--output-len` tokens out (128, ignore_eos). Every image is a different random picture,
so no request finds another's tower output or prefix in a cache. The text-only twin of each request is
as many random text ids as the image request's expanded prompt holds: the same prefill and decode work
minus the tower. Target: image output tok/s >= 0.8x the text-only run's. TTFT is each request's first
token less its arrival (`RequestOutput.metrics`), all requests submitted at once.

The tower's time per image: Ember's Qwen2.5-VL vision tower (the model's `vision_config`, random bf16
weights) over batches of `--encoder-batches` images' patches, CUDA-event timed after a warm-up.

    python benchmarks/vision.py                                           # Qwen2.5-VL-7B shape, GPU
    python benchmarks/vision.py --model DIR --num-prompts 4 --output-len 8 --image-size 56 --device cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch
from PIL import Image

if not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, bar_chart, machine_info, today, write_json
from ember import LLM, SamplingParams
from ember.model.files import resolve_model
from ember.model.hf_config import ModelConfig
from ember.model.qwen2_5_vl import Qwen25VisionTower

DEFAULT_MODEL = "benchmarks/configs/qwen2.5-vl-7b"
TARGET = 0.8
TEMPERATURE = 0.6


def model_config(model: str) -> dict[str, Any]:
    with open(os.path.join(resolve_model(model), "config.json"), encoding="utf-8") as f:
        return json.load(f)


def picture(seed: int, size: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def text_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    """Random ids from the vocabulary's lower half (a real one's special tokens sit at its top), above id 2."""
    return rng.integers(3, max(4, vocab // 2), n).tolist()


def image_requests(args: argparse.Namespace, cfg: dict[str, Any], vocab: int, seed: int) -> list[dict[str, Any]]:
    """Each: text, <vision_start> <image_pad> <vision_end>, text; the front end expands the one pad."""
    start, pad, end = (cfg[k] for k in ("vision_start_token_id", "image_token_id", "vision_end_token_id"))
    out = []
    for i in range(args.num_prompts):
        rng = np.random.default_rng(seed + i)
        text = text_ids(rng, args.text_len, vocab)
        half = len(text) // 2
        ids = text[:half] + [start, pad, end] + text[half:]
        out.append({"prompt_token_ids": ids, "multi_modal_data": {"image": picture(seed + i, args.image_size)}})
    return out


def run(llm: LLM, prompts: list[dict[str, Any]], output_len: int) -> tuple[dict[str, Any], list[int]]:
    """Output tok/s, TTFT percentiles, and each request's expanded prompt length."""
    params = SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=output_len)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = sorted(1e3 * (o.metrics.first_token_time - o.metrics.arrival_time) for o in outs)
    pct = lambda q: round(ttft[min(len(ttft) - 1, int(q * len(ttft)))], 1)  # noqa: E731
    lengths = [len(o.prompt_token_ids) for o in outs]
    row = {
        "requests": len(outs),
        "prompt_tokens": sum(lengths),
        "output_tokens": generated,
        "elapsed_s": round(wall, 3),
        "output_tok_per_s": round(generated / wall, 1),
        "ttft_ms": {"p50": round(statistics.median(ttft), 1), "p90": pct(0.9), "p99": pct(0.99)},
    }
    return row, lengths


def tower_ms_per_image(
    cfg: dict[str, Any], batches: list[int], size: int, device: torch.device, profile: int
) -> dict[str, float]:
    """The tower's milliseconds per image at each batch size (random weights and patches: the cost does not
    depend on the values); with `profile`, its kernels' table at that batch size is printed."""
    vision = ModelConfig.from_hf_config(cfg).vision
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tower = Qwen25VisionTower(vision).to(device=device, dtype=dtype).eval()
    side = size // vision.patch_size
    width = 3 * vision.temporal_patch_size * vision.patch_size**2

    def run(n: int, reps: int = 1) -> None:
        patches = torch.randn(n * side * side, width, device=device, dtype=dtype)
        with torch.inference_mode():
            for _ in range(reps):
                tower(patches, [(1, side, side)] * n)
        if device.type == "cuda":
            torch.cuda.synchronize()

    out = {}
    for n in batches:
        run(n)  # warm-up
        t0 = time.perf_counter()
        run(n, reps=5)
        out[str(n)] = round(1e3 * (time.perf_counter() - t0) / 5 / n, 3)
    if profile:
        with torch.profiler.profile() as prof:
            run(profile)
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a Qwen2.5-VL directory or config-only directory")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--text-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--encoder-batches", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--profile-tower", type=int, default=0, help="print the tower's kernels at this many images")
    ap.add_argument("--out", default=None, help="JSON path (a PNG goes next to it)")
    args = ap.parse_args()
    machine = machine_info()
    cfg = model_config(args.model)
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.num_prompts,
    )
    ready = llm.llm_engine.ready
    vocab = ready.vocab_size
    warm = image_requests(argparse.Namespace(**{**vars(args), "num_prompts": 4}), cfg, vocab, seed=1 << 20)
    run(llm, warm, 4)
    run(llm, [{"prompt_token_ids": w["prompt_token_ids"]} for w in warm], 4)
    images, lengths = run(llm, image_requests(args, cfg, vocab, seed=0), args.output_len)
    rng = np.random.default_rng(1 << 21)
    texts, _ = run(llm, [{"prompt_token_ids": text_ids(rng, n, vocab)} for n in lengths], args.output_len)
    llm.llm_engine.shutdown()
    device = torch.device(ready.device)
    tower = tower_ms_per_image(cfg, args.encoder_batches, args.image_size, device, args.profile_tower)
    ratio = round(images["output_tok_per_s"] / texts["output_tok_per_s"], 3)
    for name, row in (("with images", images), ("text only", texts)):
        print(
            f"{name:>12}: {row['output_tok_per_s']:9.1f} out tok/s  {row['elapsed_s']:7.2f} s  "
            f"TTFT p50 {row['ttft_ms']['p50']} ms, p99 {row['ttft_ms']['p99']} ms  "
            f"({row['prompt_tokens']} prompt tokens)"
        )
    print(f"ratio {ratio} (target >= {TARGET}); tower ms per image by batch: {tower}")
    out = args.out or os.path.join(RESULTS_DIR, f"vision-{os.path.basename(args.model.rstrip('/'))}-{today()}.json")
    write_json(
        out,
        {
            "benchmark": "vision",
            "date": today(),
            "machine": machine,
            "command": " ".join(sys.argv),
            "model": args.model,
            "dtype": ready.dtype,
            "device": ready.device,
            "workload": {k: getattr(args, k) for k in ("num_prompts", "image_size", "text_len", "output_len")},
            "with_images": images,
            "text_only": texts,
            "ratio": ratio,
            "target": f">= {TARGET}",
            "target_met": ratio >= TARGET,
            "tower_ms_per_image": tower,
        },
    )
    png = os.path.splitext(out)[0] + ".png"
    bars = {"with images": images["output_tok_per_s"], "text only": texts["output_tok_per_s"]}
    drew = bar_chart(png, bars, f"{args.model}: ratio {ratio}\n{machine.get('gpu') or machine['cpu']}", "output tok/s")
    print(f"wrote {out}" + (f" and {png}" if drew else ""))


if __name__ == "__main__":
    main()
