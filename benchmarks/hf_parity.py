"""Greedy parity with HF transformers on one device and dtype: how many leading tokens agree, and how
far logprobs drift before the first divergence. The exact-equality tests (tests/test_hf_equality.py)
run in float32; this script records what bf16/fp16 give, where different kernels round differently.

    python benchmarks/hf_parity.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info, today, write_json
from conftest import ARCHS, default_gguf_path, make_checkpoint

from ember import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of",
    "def add(a, b):\n    return",
    "Large language models generate text one token at a time. " * 6,
]
CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "用中文介绍一下你自己。"]


def compare(llm: LLM, hf, prompts: list[str], max_tokens: int, device: str) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    hf.generation_config.eos_token_id = None
    rows = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        ids = torch.tensor([out.prompt_token_ids], device=device)
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        ref_tokens = ref.sequences[0, ids.shape[1] :].tolist()
        ref_lp = torch.log_softmax(torch.cat(ref.logits).float(), dim=-1).cpu()
        got = out.outputs[0]
        agree = next((i for i, (a, b) in enumerate(zip(got.token_ids, ref_tokens)) if a != b), len(ref_tokens))
        drift = max(
            (abs(got.logprobs[i][t].logprob - ref_lp[i, t].item()) for i, t in enumerate(got.token_ids[:agree])),
            default=0.0,
        )
        rows.append(
            {
                "prompt_tokens": len(out.prompt_token_ids),
                "agreeing_prefix": agree,
                "of": max_tokens,
                "max_logprob_diff_before_divergence": round(drift, 5),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            path = make_checkpoint(Path(tmp) / arch, arch)
            llm = LLM(str(path), device=args.device, dtype=args.dtype, kv_cache_memory=0.1)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device)
            results[arch] = compare(llm, hf, PROMPTS, args.max_tokens, args.device)
    gguf = default_gguf_path()
    llm = LLM(device=args.device, dtype=args.dtype, kv_cache_memory=0.25, max_model_len=2048)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=dtype).to(
        args.device
    )
    tok = llm.get_tokenizer()
    chats = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT]
    results["smollm2-135m-gguf"] = compare(llm, hf, PROMPTS + chats, args.max_tokens, args.device)

    print(f"{'model':22} {'prompts':>7} {'exact':>6} {'mean agreeing prefix':>22} {'max logprob diff':>17}")
    for name, rows in results.items():
        exact = sum(r["agreeing_prefix"] == r["of"] for r in rows)
        mean = sum(r["agreeing_prefix"] for r in rows) / len(rows)
        diff = max(r["max_logprob_diff_before_divergence"] for r in rows)
        print(f"{name:22} {len(rows):>7} {exact:>6} {mean:>17.1f} / {args.max_tokens:<3} {diff:>17.5f}")
    out = args.out or f"benchmarks/results/hf-parity-{args.device}-{args.dtype}-{today()}.json"
    write_json(
        out,
        {
            "benchmark": "hf_parity",
            "date": today(),
            "machine": machine_info(),
            "command": " ".join(sys.argv),
            "config": vars(args),
            "results": results,
        },
    )
    print("wrote", out)


if __name__ == "__main__":
    main()
