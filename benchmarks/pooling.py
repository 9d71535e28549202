"""Embedding throughput (issue 32's targets): inputs/s through `LLM(...).embed(prompts)`, against the GPU's bf16
matmul roofline and against HF transformers / sentence-transformers on the same machine.

Workloads (`--workload`), random weights, fixed-length inputs:

- `qwen3-embedding`: Qwen3-Embedding-0.6B's shape (benchmarks/configs/qwen3-0.6b, `load_format="dummy"`), 4,096
  inputs of 512 random token ids, last-token pooling. Reference: the roofline. FLOPs per input = 2 x (matmul
  weights of the layers: no embedding, norms or LM head, which pooling never runs) x input_len + attention
  (4 x layers x input_len^2 x heads x head_dim, halved when causal), against the card's dense bf16 peak from
  `PEAK_BF16_TFLOPS` (or `--peak-tflops`). Target: >= 60% of it.
- `bert-base`: BERT-base's shape (benchmarks/configs/bert-base), 16,384 inputs of 128 random token ids, mean
  pooling + normalize. Reference: HF `AutoModel.from_config(attn_implementation="sdpa")` in batches of
  `--batch-size` equal-length inputs (no padding, no mask: HF at its best), mean + normalize, embeddings copied
  to the host as Ember's are. Ember loads the same random checkpoint (HF's, saved to a temporary directory).
  Target: Ember >= 2x HF.
- `minilm-cpu`: all-MiniLM-L6-v2's shape (benchmarks/configs/all-minilm-l6), 1,000 sentences of 32 tokens on CPU.
  Reference: sentence-transformers' `SentenceTransformer.encode` at batch size 32 (its default) and the best of
  `--batch-size`, on a sentence-transformers directory written here (BertModel.save_pretrained, a WordPiece
  tokenizer whose words "w<id>" are one token each, modules.json, 1_Pooling mean, Normalize) that Ember loads
  too. `encode` takes text only, so both are timed from text (tokenizing included); Ember from token ids is
  recorded beside it. Target: Ember >= 1.5x.

Each timed pass embeds every input once after a warm-up; `--repeats` passes alternate Ember and the reference
(load from outside hits both alike) and medians are kept. The first embeddings of Ember and the reference are
compared (cosine) to show that both computed the same thing. JSON and a PNG go to benchmarks/results/
(`pooling-<workload>-<device>-<date>.json`), with `uptime` taken before the run: a CPU figure at load >= 1 is
marked `loaded`.

    python benchmarks/pooling.py --workload qwen3-embedding            # GPU
    python benchmarks/pooling.py --workload bert-base                  # GPU
    python benchmarks/pooling.py --workload minilm-cpu                 # CPU
    python benchmarks/pooling.py --workload qwen3-embedding --device cpu --dtype float32 --num-inputs 8 \\
        --input-len 16 --config-override '{"num_hidden_layers": 2}'   # a quick check of the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

if not __package__:  # run as a script: make `benchmarks.common` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from benchmarks.common import RESULTS_DIR, machine_info, today, write_json
from ember import LLM
from ember.bench.machine import REPO_ROOT
from ember.model.hf_config import ENCODER_ARCHITECTURES

CONFIGS = os.path.join(REPO_ROOT, "benchmarks", "configs")
# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets, TFLOP/s, by a part of
# torch.cuda.get_device_name; the first match wins. The H100 SXM calls itself "H100 80GB HBM3".
PEAK_BF16_TFLOPS = (
    ("H200", 989.0),
    ("H100 80GB HBM3", 989.0),
    ("H100 SXM", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("A100", 312.0),
)
COMPARED = 16  # embeddings compared between Ember and the reference


@dataclass(frozen=True)
class Workload:
    config: str  # directory under benchmarks/configs
    num_inputs: int
    input_len: int
    pooling: str  # Ember's pooler_config pooling_type
    device: str
    dtype: str
    reference: str  # "roofline", "hf" or "sentence-transformers"
    batch_sizes: tuple[int, ...]  # the reference's; the first is the headline one
    target: float  # of the roofline, or Ember / reference


WORKLOADS = {
    "qwen3-embedding": Workload("qwen3-0.6b", 4096, 512, "LAST", "cuda", "bfloat16", "roofline", (), 0.6),
    "bert-base": Workload("bert-base", 16384, 128, "MEAN", "cuda", "bfloat16", "hf", (256,), 2.0),
    "minilm-cpu": Workload(
        "all-minilm-l6", 1000, 32, "MEAN", "cpu", "float32", "sentence-transformers", (32, 16, 64, 128), 1.5
    ),
}


# ---- the model and its inputs -------------------------------------------------------------------------------


def load_config(args: argparse.Namespace) -> dict[str, Any]:
    path = args.model or os.path.join(CONFIGS, args.wl.config)
    with open(path if path.endswith(".json") else os.path.join(path, "config.json"), encoding="utf-8") as f:
        return {**json.load(f), **json.loads(args.config_override or "{}")}


def is_encoder(cfg: dict[str, Any]) -> bool:
    return cfg.get("architectures", [""])[0] in ENCODER_ARCHITECTURES


def flops_per_input(cfg: dict[str, Any], length: int) -> tuple[float, int]:
    """(FLOPs of one input of `length` tokens, matmul weights counted): 2 per weight per token, plus QK^T and PV
    over every key (an encoder) or half of them (a decoder's causal mask)."""
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, cfg.get("num_key_value_heads", heads) * head_dim
    encoder = is_encoder(cfg)
    mlp = (2 if encoder else 3) * hidden * cfg["intermediate_size"]  # BERT: in, out; decoders: gate, up, down
    params = layers * (hidden * q + 2 * hidden * kv + q * hidden + mlp)
    attention = 4 * layers * length**2 * q / (1 if encoder else 2)
    return 2 * params * length + attention, params


def random_ids(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Token ids in [5, vocab): clear of the special tokens the sentence-transformers tokenizer puts first."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n, length), generator=gen).tolist()


def write_tokenizer(path: str, vocab_size: int) -> None:
    """A WordPiece tokenizer in BERT's layout whose words "w<id>" are token <id> each (an HF directory for Ember
    needs a tokenizer.json, even when it is given token ids)."""
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(len(specials), vocab_size)])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        **dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), specials)),
    )
    fast.save_pretrained(path)


def write_st_dir(path: str, cfg: dict[str, Any], seed: int) -> None:
    """A sentence-transformers directory of a random BertModel: the model, `write_tokenizer`'s tokenizer, and the
    Transformer -> Pooling (mean) -> Normalize modules, as all-MiniLM-L6-v2's."""
    import transformers

    torch.manual_seed(seed)
    transformers.BertModel(transformers.BertConfig(**cfg)).eval().save_pretrained(path)
    write_tokenizer(path, cfg["vocab_size"])
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    files = {
        "modules.json": [
            {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
            for i, (p, t) in enumerate(modules)
        ],
        "sentence_bert_config.json": {"max_seq_length": cfg["max_position_embeddings"], "do_lower_case": False},
        "1_Pooling/config.json": {
            "word_embedding_dimension": cfg["hidden_size"],
            **{f"pooling_mode_{m}": m == "mean_tokens" for m in ("cls_token", "mean_tokens", "max_tokens")},
            "pooling_mode_mean_sqrt_len_tokens": False,
        },
    }
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    for name, content in files.items():
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)


# ---- timing -------------------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def seconds(run: Callable[[], Any], device: str) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = run()
    sync(device)
    return time.perf_counter() - start, out


def ember_embed(llm: LLM, prompts: list[Any]) -> list[Any]:
    """The API's outputs (each vector a list of floats); `vectors` makes a tensor of them outside the timing."""
    return llm.embed(prompts, use_tqdm=False)


def vectors(outputs: list[Any]) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs[:COMPARED]])


def hf_embed(model: torch.nn.Module, ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Mean pooling + normalize over equal-length batches (every token real: no mask), on the host at the end."""
    out = []
    with torch.inference_mode():
        for i in range(0, len(ids), batch_size):
            hidden = model(input_ids=ids[i : i + batch_size]).last_hidden_state
            out.append(F.normalize(hidden.float().mean(1), dim=-1))
    return torch.cat(out).cpu()


def min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    n = min(COMPARED, len(a), len(b))
    return round(F.cosine_similarity(a[:n].float(), b[:n].float(), dim=-1).min().item(), 6)


def summary(runs_s: list[float], num_inputs: int, input_len: int) -> dict[str, Any]:
    median = statistics.median(runs_s)
    return {
        "inputs_per_s": round(num_inputs / median, 2),
        "tokens_per_s": round(num_inputs * input_len / median, 1),
        "median_s": round(median, 4),
        "runs_s": [round(s, 4) for s in runs_s],
    }


# ---- the three references -----------------------------------------------------------------------------------


def engine(args: argparse.Namespace, model: str, **kwargs: Any) -> LLM:
    args.engine_kwargs = dict(
        model=model,
        device=args.device,
        dtype=args.dtype,
        runner="pooling",
        max_model_len=args.input_len,
        enable_prefix_caching=False,  # repeats of the same inputs must not hit
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        engine_process=args.engine_process,
        seed=args.seed,
        **kwargs,
    )
    llm = LLM(**args.engine_kwargs)
    ready = llm.llm_engine.ready
    fields = ("description", "device", "dtype", "pooling_type", "runner", "encoder", "hidden_size")
    args.ember_ready = {k: getattr(ready, k, None) for k in fields}
    return llm


def run_roofline(args: argparse.Namespace, model: str, ids: list[list[int]], warm: list[list[int]]) -> dict:
    llm = engine(args, model, load_format=args.load_format, pooler_config={"pooling_type": args.wl.pooling})
    prompts = [{"prompt_token_ids": p} for p in ids]
    ember_embed(llm, [{"prompt_token_ids": p} for p in warm])
    runs = [seconds(lambda: ember_embed(llm, prompts), "cpu")[0] for _ in range(args.repeats)]
    llm.llm_engine.shutdown()
    return {"ember": summary(runs, len(ids), args.input_len)}


def run_hf(args: argparse.Namespace, cfg: dict[str, Any], ids: list[list[int]], warm: list[list[int]]) -> dict:
    """HF AutoModel (sdpa) on the device, and Ember on the same random checkpoint, passes alternated."""
    import transformers

    dtype = getattr(torch, args.ref_dtype)
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(args.seed)
    hf = transformers.AutoModel.from_config(config, attn_implementation="sdpa", dtype=dtype).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        write_tokenizer(tmp, cfg["vocab_size"])
        llm = engine(args, tmp, pooler_config={"pooling_type": args.wl.pooling})
    hf = hf.to(args.device)
    x, x_warm = (torch.tensor(v, device=args.device) for v in (ids, warm))
    prompts = [{"prompt_token_ids": p} for p in ids]
    ember_embed(llm, [{"prompt_token_ids": p} for p in warm])
    for bs in args.batch_size:
        hf_embed(hf, x_warm[:bs], bs)
    runs: dict[str, list[float]] = {"ember": [], **{f"hf_bs{bs}": [] for bs in args.batch_size}}
    outs: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        s, got = seconds(lambda: ember_embed(llm, prompts), args.device)
        runs["ember"].append(s)
        outs["ember"] = vectors(got)
        for bs in args.batch_size:
            s, outs["hf"] = seconds(lambda bs=bs: hf_embed(hf, x, bs), args.device)
            runs[f"hf_bs{bs}"].append(s)
    llm.llm_engine.shutdown()
    res = {k: summary(v, len(ids), args.input_len) for k, v in runs.items()}
    return {**res, "min_cosine_ember_vs_reference": min_cosine(outs["ember"], outs["hf"])}


def run_st(args: argparse.Namespace, cfg: dict[str, Any], ids: list[list[int]], warm: list[list[int]]) -> dict:
    """sentence-transformers' encode and Ember on one directory, both from text; Ember from ids beside them."""
    from sentence_transformers import SentenceTransformer

    texts, warm_texts = ([" ".join(f"w{t}" for t in p[1:-1]) for p in v] for v in (ids, warm))
    with tempfile.TemporaryDirectory() as tmp:
        write_st_dir(tmp, cfg, args.seed)
        st = SentenceTransformer(tmp, device=args.device, model_kwargs={"dtype": getattr(torch, args.ref_dtype)})
        llm = engine(args, tmp)
    first = llm.embed(texts[:1], use_tqdm=False)[0]
    if first.prompt_token_ids != ids[0]:
        raise RuntimeError(f"the tokenizer made {len(first.prompt_token_ids)} tokens, not the {args.input_len} asked")
    prompts = [{"prompt_token_ids": p} for p in ids]
    ember_embed(llm, warm_texts)
    for bs in args.batch_size:
        st.encode(warm_texts[:bs], batch_size=bs)
    runs: dict[str, list[float]] = {"ember": [], "ember_from_ids": [], **{f"st_bs{bs}": [] for bs in args.batch_size}}
    outs: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        s, got = seconds(lambda: ember_embed(llm, texts), "cpu")
        runs["ember"].append(s)
        outs["ember"] = vectors(got)
        runs["ember_from_ids"].append(seconds(lambda: ember_embed(llm, prompts), "cpu")[0])
        for bs in args.batch_size:
            s, outs["st"] = seconds(lambda bs=bs: torch.from_numpy(st.encode(texts, batch_size=bs)), args.device)
            runs[f"st_bs{bs}"].append(s)
    llm.llm_engine.shutdown()
    res = {k: summary(v, len(ids), args.input_len) for k, v in runs.items()}
    return {**res, "min_cosine_ember_vs_reference": min_cosine(outs["ember"], outs["st"])}


# ---- what the numbers say -----------------------------------------------------------------------------------


def peak_tflops(args: argparse.Namespace) -> tuple[float | None, str]:
    if args.peak_tflops:
        return args.peak_tflops, "--peak-tflops"
    if not args.device.startswith("cuda"):
        return None, "no GPU: no bf16 peak"
    name = torch.cuda.get_device_name(torch.device(args.device))
    for part, peak in PEAK_BF16_TFLOPS:
        if part in name:
            return peak, f"{name}: dense bf16 peak from the table ({part})"
    return None, f"{name}: not in PEAK_BF16_TFLOPS (give --peak-tflops)"


def measured_matmul_tflops(device: str) -> float | None:
    """An 8192^3 bf16 matmul's rate: what the card's tensor cores reach here, beside the data sheet's peak."""
    if not device.startswith("cuda"):
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    a @ a
    s, _ = seconds(lambda: [a @ a for _ in range(20)], device)
    return round(20 * 2 * 8192**3 / s / 1e12, 1)


def roofline(args: argparse.Namespace, cfg: dict[str, Any], ember_inputs_per_s: float) -> dict[str, Any]:
    flops, params = flops_per_input(cfg, args.input_len)
    peak, source = peak_tflops(args)
    achieved = ember_inputs_per_s * flops / 1e12
    return {
        "flops_per_input": flops,
        "matmul_params": params,
        "achieved_tflops": round(achieved, 2),
        "peak_tflops": peak,
        "peak_source": source,
        "roofline_inputs_per_s": round(peak * 1e12 / flops, 1) if peak else None,
        "fraction_of_peak": round(achieved / peak, 4) if peak else None,
        "measured_matmul_tflops": measured_matmul_tflops(args.device),
    }


def verdict(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    if args.wl.reference == "roofline":
        frac = results["roofline"]["fraction_of_peak"]
        met = None if frac is None else frac >= args.wl.target
        return {
            "target": f">= {args.wl.target} of the bf16 roofline",
            "target_value": args.wl.target,
            "target_met": met,
        }
    prefix = "hf" if args.wl.reference == "hf" else "st"
    ref = {bs: results[f"{prefix}_bs{bs}"]["inputs_per_s"] for bs in args.batch_size}
    best = max(ref, key=ref.__getitem__)
    ember = results["ember"]["inputs_per_s"]
    ratio, ratio_best = ember / ref[args.batch_size[0]], ember / ref[best]
    return {
        "target": f"Ember >= {args.wl.target}x {args.wl.reference}",
        "target_value": args.wl.target,
        "ratio": round(ratio, 3),
        "reference_batch_size": args.batch_size[0],
        "ratio_vs_best": round(ratio_best, 3),
        "best_batch_size": best,
        "target_met": ratio >= args.wl.target,
        "target_met_vs_best": ratio_best >= args.wl.target,
    }


def print_table(results: dict[str, Any], out: dict[str, Any]) -> None:
    print(f"{'run':<16}{'inputs/s':>11}{'tokens/s':>13}{'median s':>10}")
    for name, r in results.items():
        if isinstance(r, dict) and "inputs_per_s" in r:
            print(f"{name:<16}{r['inputs_per_s']:>11.1f}{r['tokens_per_s']:>13.0f}{r['median_s']:>10.3f}")
    if "roofline" in results:
        r = results["roofline"]
        frac = "n/a" if r["fraction_of_peak"] is None else f"{r['fraction_of_peak']:.1%}"
        print(f"{r['flops_per_input'] / 1e9:.4g} GFLOP per input; {r['achieved_tflops']} TFLOP/s = {frac} of the peak")
        print(f"peak: {r['peak_source']}")
        if r["measured_matmul_tflops"]:
            print(f"measured 8192^3 bf16 matmul: {r['measured_matmul_tflops']} TFLOP/s")
    if "min_cosine_ember_vs_reference" in results:
        print(f"min cosine, Ember vs reference, first {COMPARED} inputs: {results['min_cosine_ember_vs_reference']}")
    v = out["verdict"]
    if "ratio" in v:
        print(f"Ember / reference: {v['ratio']}x (bs {v['reference_batch_size']}), {v['ratio_vs_best']}x (best)")
    print(f"target {v['target']}: met = {v['target_met']}")


def write_chart(path: str, results: dict[str, Any], title: str, verdict: dict[str, Any]) -> None:
    """Inputs/s per run, with the roofline or the target line. Optional: without matplotlib there is no chart."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {k: v["inputs_per_s"] for k, v in results.items() if isinstance(v, dict) and "inputs_per_s" in v}
    fig, ax = plt.subplots(figsize=(6, 3.8))
    colors = ["#d9541e" if k.startswith("ember") else "#4a7ab5" for k in runs]
    ax.bar_label(ax.bar(list(runs), list(runs.values()), color=colors), fmt="%.0f", fontsize=8)
    roof = results.get("roofline", {}).get("roofline_inputs_per_s")
    if roof:
        ax.axhline(roof, color="black", linewidth=1, label="bf16 roofline")
        label = f"target: {verdict['target_value']:.0%}"
        ax.axhline(verdict["target_value"] * roof, color="gray", linestyle="--", linewidth=1, label=label)
    elif "best_batch_size" in verdict:
        target = results["ember"]["inputs_per_s"] / verdict["ratio_vs_best"] * verdict["target_value"]
        label = f"target: {verdict['target_value']}x the best batch size ({verdict['best_batch_size']})"
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=label)
    if roof or "best_batch_size" in verdict:
        ax.legend(fontsize=7)
    ax.set_ylabel("inputs / s (median)")
    ax.tick_params(labelsize=8)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return f"load average: {', '.join(f'{x:.2f}' for x in os.getloadavg())}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True, choices=WORKLOADS)
    p.add_argument("--model", default=None, help="config directory or config.json (default: the workload's)")
    p.add_argument("--config-override", default=None, help="JSON merged into the config, e.g. a smaller shape")
    p.add_argument("--load-format", default="dummy", help="qwen3-embedding's (default: dummy, random weights)")
    p.add_argument("--device", default=None, help="default: the workload's (cuda; cpu for minilm-cpu)")
    p.add_argument("--dtype", default=None, help="Ember's (default: bfloat16 on GPU, float32 for minilm-cpu)")
    p.add_argument("--ref-dtype", default=None, help="HF's / sentence-transformers' (default: --dtype)")
    p.add_argument("--num-inputs", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None, help="tokens per input, special tokens included")
    p.add_argument("--batch-size", type=int, nargs="+", default=None, help="the reference's; the first is the headline")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--repeats", type=int, default=3, help="timed passes of each (medians kept)")
    p.add_argument("--warmup", type=int, default=256, help="inputs embedded first by each (default: 256)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not in the table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSON path; a PNG goes next to it if matplotlib is installed")
    args = p.parse_args(argv)
    wl = args.wl = WORKLOADS[args.workload]
    args.device = args.device or wl.device
    args.dtype = args.dtype or wl.dtype
    args.ref_dtype = args.ref_dtype or args.dtype
    args.num_inputs = args.num_inputs or wl.num_inputs
    args.input_len = args.input_len or wl.input_len
    args.batch_size = args.batch_size or list(wl.batch_sizes)
    if min(args.num_inputs, args.input_len, args.repeats, args.warmup, *args.batch_size) < 1:
        p.error("--num-inputs, --input-len, --repeats, --warmup and --batch-size must be >= 1")
    if wl.reference == "sentence-transformers" and args.input_len < 3:
        p.error("--input-len: at least 3 tokens ([CLS], a word, [SEP])")
    name = f"pooling-{args.workload}-{args.device.split(':')[0]}-{today()}.json"
    args.output = args.output or os.path.join(RESULTS_DIR, name)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    load = uptime()  # before anything runs: the CPU is shared
    machine = machine_info()
    cfg = load_config(args)
    wl = args.wl
    if wl.reference == "roofline":
        model = args.model or os.path.join(CONFIGS, wl.config)
        tmp = None
        if args.config_override:
            tmp = tempfile.TemporaryDirectory()
            model = tmp.name
            write_json(os.path.join(tmp.name, "config.json"), cfg)
        ids = random_ids(args.num_inputs, args.input_len, cfg["vocab_size"], args.seed)
        warm = random_ids(min(args.warmup, args.num_inputs), args.input_len, cfg["vocab_size"], args.seed + 1)
        results = run_roofline(args, model, ids, warm)
        if tmp is not None:
            tmp.cleanup()
    else:
        ids = random_ids(args.num_inputs, args.input_len - 2, cfg["vocab_size"], args.seed)
        warm = random_ids(min(args.warmup, args.num_inputs), args.input_len - 2, cfg["vocab_size"], args.seed + 1)
        ids, warm = ([[2, *p, 3] for p in v] for v in (ids, warm))  # [CLS] ... [SEP], as the tokenizer makes them
        results = (run_hf if wl.reference == "hf" else run_st)(args, cfg, ids, warm)
    results["roofline"] = roofline(args, cfg, results["ember"]["inputs_per_s"])
    loadavg = machine.get("loadavg") or [0.0]
    out = {
        "benchmark": "pooling",
        "date": today(),
        "machine": machine,
        "command": " ".join(sys.argv),
        "uptime_before": load,
        "loaded": args.device == "cpu" and loadavg[0] >= 1.0,
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("wl", "engine_kwargs", "ember_ready")},
            "workload_definition": vars(wl),
            "model_config": cfg,
            "engine_kwargs": {k: v for k, v in args.engine_kwargs.items() if k != "model"},
            "ember_resolved": args.ember_ready,
        },
        "timed_from": "text (SentenceTransformer.encode takes no token ids), tokenizing included; "
        "ember_from_ids: the same inputs as token ids"
        if wl.reference == "sentence-transformers"
        else "token ids (no tokenizing)",
        "results": results,
    }
    out["verdict"] = verdict(args, results)
    print_table(results, out)
    if out["loaded"]:
        print(f"WARNING: load {loadavg[0]} >= 1 before the run: the CPU was shared ({load})")
    write_json(args.output, out)
    png = os.path.splitext(args.output)[0] + ".png"
    title = f"{args.workload}: {args.num_inputs} x {args.input_len} tokens, {args.device}, {args.dtype}"
    if out["loaded"]:
        title += f" (load {loadavg[0]} before: a shared CPU)"
    write_chart(png, results, f"{title}\n{machine.get('gpu') or machine['cpu']}", out["verdict"])
    print(f"wrote {args.output}" + (f" and {png}" if os.path.exists(png) else ""))


if __name__ == "__main__":
    main()
