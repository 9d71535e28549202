"""Quantized GEMM timings on the GPU: which kernel and config serve which batch size.

For Llama-3.1-8B's linear layers (q/k/v and gate/up fused as Ember runs them) and each row count M,
times bf16 cuBLAS, the first fused kernel (quant_matmul), dequantize + cuBLAS (from the file layout
and from the packed one) and the packed kernel (quant_packed) over a small sweep of configs, with
int4 (group 128, zeros: `--quantization int4`) and int8 (per channel: `--quantization int8`) weights.
Every config's output is checked against dequantize + a float32 product before it is timed. The
fastest correct config per (kind, shape, M) whose sweep ran whole is merged into the table the packed
kernel reads (ember/kernels/quant_packed_configs.json, and a copy beside --out): the table's other
entries stay, so a run over a few rows or one kind retunes those alone.

Each timed call runs the matmul over enough copies of the weight to pass 256 MB, one after another
(the way a decode step streams its layers), so the weights come from HBM rather than the 60 MB L2;
GB/s counts the weight bytes read against the H200's 4.3 TB/s. One failing config is recorded and
skipped; past --time-limit the remaining sweeps are skipped and their rows keep the table's entries.

    python benchmarks/quant_gemm.py --out benchmarks/results/quant-gemm-cuda-<date>.json
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, cuda_graph_us, machine_info, today, write_json
from ember.kernels.paged import num_sms
from ember.kernels.quant_matmul import dequantize_kernel, quant_matmul
from ember.kernels.quant_packed import (
    CONFIG_TABLE,
    PackedConfig,
    PackedQuantWeight,
    choose_packed_config,
    dequantize_packed,
    pack_weight,
    packed_matmul,
)
from ember.quant.formats import QuantizedWeight
from ember.quant.quantize import quantize

SHAPES_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
ROWS = [1, 2, 4, 8, 16, 32, 64]
CROSSOVER_ROWS = [128, 256]  # the packed kernel's default against dequantize + cuBLAS, no sweep
KINDS = ("int4", "int8")
PEAK_GBPS = 4300.0
STREAM_BYTES = 256 * 2**20
FMA_MAX_ROWS = 4  # one-row programs re-read each weight tile per row: beyond a few rows the dot variant wins
MMA_MAX_ROWS = 16  # the "mma" variant's tensor-core tile holds 16 activation rows


def sweep(m: int, n: int, k: int, kind: str, sms: int) -> list[PackedConfig]:
    """The default, then one-row FMA configs (M <= FMA_MAX_ROWS), weight-as-M tensor-core configs
    (M <= MMA_MAX_ROWS) and activation-as-M ones, with split-K aimed at 1 to 8 programs per SM."""
    default = choose_packed_config(m, n, k, kind, sms, table_path="")
    k_tiles = -(-k // (128 if kind == "int4" else 64))

    def split(block_m: int, block_n: int, per_sm: int) -> int:
        tiles = -(-m // block_m) * -(-n // block_n)
        return max(1, min(-(-per_sm * sms // tiles), k_tiles, 32))

    configs = [default]
    if m <= FMA_MAX_ROWS:
        configs += [
            PackedConfig("fma", 1, bn, split(1, bn, per_sm), 8 if bn == 256 else 4, 2)
            for bn, per_sm in ((64, 4), (128, 2), (128, 4), (128, 8), (256, 2), (256, 4), (256, 8))
        ]
    if m <= MMA_MAX_ROWS:
        configs += [
            PackedConfig("mma", 16, bn, split(16, bn, per_sm), warps, stages)
            for bn, warps, per_sm, stages in (
                (128, 4, 2, 2),
                (128, 4, 4, 2),
                (128, 4, 4, 3),
                (256, 4, 1, 2),
                (256, 4, 2, 2),
                (256, 4, 4, 2),
                (256, 8, 2, 2),
            )
        ]
    block_m = min(64, max(16, 1 << (m - 1).bit_length()))
    configs += [
        PackedConfig("dot", block_m, bn, split(block_m, bn, per_sm), 4, stages)
        for bn, per_sm, stages in ((32, 2, 2), (32, 4, 2), (64, 2, 2), (64, 4, 2), (64, 4, 3), (128, 2, 2), (128, 4, 2))
    ]
    return list(dict.fromkeys(configs))


def copies(make: Callable[[], object], nbytes: int) -> list:
    """Enough copies of a weight to pass STREAM_BYTES (at most 64)."""
    return [make() for _ in range(max(1, min(64, -(-STREAM_BYTES // max(nbytes, 1)))))]


def clone_quantized(w: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(
        w.kind,
        w.qweight.clone(),
        w.scales.clone(),
        None if w.zeros is None else w.zeros.clone(),
        w.group_size,
        w.in_features,
    )


def clone_packed(w: PackedQuantWeight) -> PackedQuantWeight:
    return PackedQuantWeight(
        w.kind,
        w.qweight.clone(),
        w.scales.clone(),
        None if w.zeros is None else w.zeros.clone(),
        w.group_size,
        w.in_features,
    )


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Timer:
    """us per matmul of `fn` over a list of weight copies, in a CUDA graph; None (with the error
    recorded) when the call fails, is wrong, or (unless forced) the time limit has passed."""

    def __init__(self, time_limit: float) -> None:
        self.start = time.monotonic()
        self.deadline = self.start + time_limit
        self.errors: list[str] = []
        self.skipped = 0

    def __call__(
        self,
        label: str,
        fn: Callable[[object], torch.Tensor],
        weights: list,
        expected: torch.Tensor | None = None,
        force: bool = False,
    ) -> float | None:
        if not force and time.monotonic() > self.deadline:
            self.skipped += 1
            return None
        try:
            out = fn(weights[0])
            if expected is not None:
                err = ((out.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()
                if not err < 2e-2:
                    raise AssertionError(f"relative error {err:.3g}")
            return cuda_graph_us(lambda: [fn(w) for w in weights], 10, "median") / len(weights)
        except Exception as e:  # noqa: BLE001 - one failing config must not end the run
            self.errors.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
            print("  FAILED", self.errors[-1], flush=True)
            return None


@dataclass
class Case:
    """One (shape, kind): the weight in each form, in enough copies to stream from HBM."""

    name: str
    n: int
    k: int
    kind: str
    dense: list[torch.Tensor]
    old: list[QuantizedWeight]
    packed: list[PackedQuantWeight]
    reference_t: torch.Tensor  # float32 W^T (x @ it is the product)

    @property
    def packed_bytes(self) -> int:
        return nbytes(self.packed[0].tensors())


def make_cases(args: argparse.Namespace, gen: torch.Generator) -> list[Case]:
    cases = []
    for name, n, k in SHAPES_8B:
        if name not in args.shapes:
            continue
        dense = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        dense_copies = copies(dense.clone, dense.numel() * 2)
        for kind in args.kinds:
            qw = quantize(dense, kind)
            packed = pack_weight(qw)
            cases.append(
                Case(
                    name,
                    n,
                    k,
                    kind,
                    dense_copies,
                    copies(functools.partial(clone_quantized, qw), nbytes(qw.tensors())),
                    copies(functools.partial(clone_packed, packed), nbytes(packed.tensors())),
                    dequantize_packed(packed, torch.float32).t(),
                )
            )
    return cases


def baselines(
    case: Case, m: int, x: torch.Tensor, expected: torch.Tensor, timer: Timer, bf16: dict[tuple[str, int], float | None]
) -> dict[str, float | None]:
    """bf16 cuBLAS (once per shape), the first fused kernel, both dequantize + cuBLAS paths."""
    label = f"{case.name} {case.kind} M={m}"
    if (case.name, m) not in bf16:
        bf16[case.name, m] = timer(f"{label} bf16", lambda w: F.linear(x, w), case.dense, force=True)
    return {
        "bf16": bf16[case.name, m],
        "old_fused": timer(f"{label} old", lambda w: quant_matmul(x, w), case.old, expected, force=True),
        "old_deq": timer(
            f"{label} old deq", lambda w: F.linear(x, dequantize_kernel(w, x.dtype)), case.old, expected, force=True
        ),
        "packed_deq": timer(
            f"{label} packed deq",
            lambda w: F.linear(x, dequantize_packed(w, x.dtype)),
            case.packed,
            expected,
            force=True,
        ),
    }


def run(args: argparse.Namespace, timer: Timer, write: Callable[[list[dict]], None]) -> list[dict]:
    """Baselines and the default config for every case and M first (forced), then the sweeps, M = 1
    first, so a run that reaches its time limit has tuned the rows that matter most."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = num_sms(torch.device("cuda"))
    cases = make_cases(args, gen)
    inputs = {
        (k, m): torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        for k in {c.k for c in cases}
        for m in args.rows
    }
    bf16: dict[tuple[str, int], float | None] = {}
    rows: dict[tuple[str, str, int], dict] = {}
    timed: dict[tuple[str, str, int], list[tuple[float, PackedConfig]]] = {}

    def time_config(case: Case, m: int, cfg: PackedConfig, force: bool) -> None:
        x = inputs[case.k, m]
        t = timer(
            f"{case.name} {case.kind} M={m} {tuple(cfg)}",
            lambda w: packed_matmul(x, w, config=cfg),
            case.packed,
            rows[case.name, case.kind, m]["expected"],
            force=force,
        )
        if t is not None:
            timed[case.name, case.kind, m].append((t, cfg))

    for case in cases:
        for m in args.rows:
            x = inputs[case.k, m]
            expected = x.float() @ case.reference_t
            default = choose_packed_config(m, case.n, case.k, case.kind, sms, table_path="")
            rows[case.name, case.kind, m] = {"expected": expected, "us": baselines(case, m, x, expected, timer, bf16)}
            timed[case.name, case.kind, m] = []
            time_config(case, m, default, force=True)
            rows[case.name, case.kind, m]["us"]["packed_default"] = next(iter(timed[case.name, case.kind, m]), (None,))[
                0
            ]
        print(f"baselines: {case.name} {case.kind} done ({time.monotonic() - timer.start:.0f} s)", flush=True)
    results = collect(cases, args.rows, rows, timed)
    write(results)
    if args.sweep:
        for m in sorted(set(args.rows) & set(ROWS)):
            for case in cases:
                skipped = timer.skipped
                for cfg in sweep(m, case.n, case.k, case.kind, sms)[1:]:
                    if cfg.variant in args.variants:
                        time_config(case, m, cfg, force=False)
                rows[case.name, case.kind, m]["swept"] = timer.skipped == skipped
            results = collect(cases, args.rows, rows, timed)
            write(results)
            print(f"sweep: M={m} done ({time.monotonic() - timer.start:.0f} s)", flush=True)
    return results


def collect(cases: list[Case], ms: list[int], rows: dict, timed: dict) -> list[dict]:
    results = []
    for case in cases:
        for m in ms:
            key = (case.name, case.kind, m)
            best = min(timed[key], default=None, key=lambda r: r[0])
            results.append(
                {
                    "shape": case.name,
                    "n": case.n,
                    "k": case.k,
                    "m": m,
                    "kind": case.kind,
                    "packed_weight_bytes": case.packed_bytes,
                    "swept": rows[key].get("swept", False),
                    "us": {c: None if v is None else round(v, 2) for c, v in rows[key]["us"].items()},
                    "packed_best": None if best is None else {"us": round(best[0], 2), "config": best[1]._asdict()},
                    "configs_timed": [{"us": round(t, 2), "config": c._asdict()} for t, c in timed[key]],
                }
            )
    return results


def print_results(results: list[dict]) -> None:
    cols = ("bf16", "old_fused", "old_deq", "packed_deq", "packed_default")
    print(
        f"{'shape':>8} {'kind':>5} {'M':>4} "
        + " ".join(f"{c:>14}" for c in cols + ("packed_best",))
        + f" {'GB/s':>7} {'peak':>5}  best config   (us per matmul)"
    )
    for r in results:
        best = r["packed_best"]
        vals = [r["us"][c] for c in cols] + [best["us"] if best else None]
        line = f"{r['shape']:>8} {r['kind']:>5} {r['m']:>4} " + " ".join(
            f"{v:>14.1f}" if v is not None else f"{'-':>14}" for v in vals
        )
        if best:
            bw = r["packed_weight_bytes"] / best["us"] / 1e3
            line += f" {bw:>7.0f} {100 * bw / PEAK_GBPS:>4.0f}%  {tuple(best['config'].values())}"
        print(line)


def table_entries(results: list[dict]) -> list[dict]:
    return [
        {
            "kind": r["kind"],
            "n": r["n"],
            "k": r["k"],
            "m": r["m"],
            "us": r["packed_best"]["us"],
            "config": r["packed_best"]["config"],
        }
        for r in results
        if r["packed_best"] is not None and r["swept"]
    ]


def merged_table(path: str, table: dict) -> dict:
    """`table` over the entries of the one at `path` (if any): an entry this run measured replaces the old
    one of its (kind, N, K, M); the others stay, with the device that measured them named."""
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError):
        return table
    key = operator.itemgetter("kind", "n", "k", "m")
    new_keys = {key(e) for e in table["entries"]}
    kept = [e for e in old.get("entries", []) if key(e) not in new_keys]
    if not kept:
        return table
    devices = list(dict.fromkeys([*old.get("device", "").split("; "), table["device"]]))
    return {**table, "device": "; ".join(d for d in devices if d), "entries": sorted(kept + table["entries"], key=key)}


def summary(results: list[dict]) -> dict:
    """Per kind and M: the linear layers of one 8B decoder layer summed, x 32 layers (no LM head); the
    largest M where the packed kernel beats dequantize + cuBLAS is PACKED_MAX_ROWS's measurement."""
    out = {}
    for kind in sorted({r["kind"] for r in results}):
        for m in sorted({r["m"] for r in results}):
            rows = [r for r in results if r["kind"] == kind and r["m"] == m]
            if len(rows) != len(SHAPES_8B) or any(r["packed_best"] is None or r["us"]["bf16"] is None for r in rows):
                continue
            best = sum(r["packed_best"]["us"] for r in rows)
            deq = None if any(r["us"]["packed_deq"] is None for r in rows) else sum(r["us"]["packed_deq"] for r in rows)
            out[f"{kind}/M={m}"] = {
                "packed_ms_32_layers": round(best * 32 / 1e3, 3),
                "dequant_cublas_ms_32_layers": None if deq is None else round(deq * 32 / 1e3, 3),
                "bf16_ms_32_layers": round(sum(r["us"]["bf16"] for r in rows) * 32 / 1e3, 3),
                "packed_gbps": round(sum(r["packed_weight_bytes"] for r in rows) / best / 1e3),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS + CROSSOVER_ROWS)
    ap.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    ap.add_argument("--shapes", nargs="*", default=[s[0] for s in SHAPES_8B], choices=[s[0] for s in SHAPES_8B])
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--variants",
        nargs="*",
        default=["fma", "dot", "mma"],
        choices=["fma", "dot", "mma"],
        help="what the sweep times",
    )
    ap.add_argument(
        "--time-limit",
        type=float,
        default=170.0,
        help="seconds from the start after which no further sweep config is timed",
    )
    ap.add_argument("--table", default=CONFIG_TABLE, help="where to write the packed kernel's config table ('' = none)")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, f"quant-gemm-cuda-{today()}.json"))
    args = ap.parse_args()
    timer = Timer(args.time_limit)
    machine = machine_info()

    def write(results: list[dict]) -> None:
        """Results and table after each phase, so a run cut short keeps what it measured."""
        table = {
            "device": torch.cuda.get_device_name(),
            "date": today(),
            "source": "benchmarks/quant_gemm.py",
            "entries": table_entries(results),
        }
        write_json(
            args.out,
            {
                "benchmark": "quant_gemm",
                "date": today(),
                "machine": machine,
                "command": sys.argv,
                "config": vars(args),
                "seconds": round(time.monotonic() - timer.start, 1),
                "summary": summary(results),
                "errors": timer.errors,
                "skipped_after_time_limit": timer.skipped,
                "table": table,
                "results": results,
            },
        )
        if args.table:
            write_json(args.table, merged_table(args.table, table))
            beside = os.path.join(os.path.dirname(os.path.abspath(args.out)), os.path.basename(args.table))
            if beside != os.path.abspath(args.table):
                shutil.copyfile(args.table, beside)

    results = run(args, timer, write)
    print_results(results)
    for key, row in summary(results).items():
        print(
            f"{key:>10}: packed {row['packed_ms_32_layers']} ms per token of linear layers (dequantize + cuBLAS "
            f"{row['dequant_cublas_ms_32_layers']} ms, bf16 {row['bf16_ms_32_layers']} ms), "
            f"{row['packed_gbps']} GB/s of {PEAK_GBPS:.0f}"
        )
    print(
        f"{len(timer.errors)} failures, {timer.skipped} configs skipped at the time limit; "
        f"{time.monotonic() - timer.start:.0f} s; wrote {args.out}" + (f" and {args.table}" if args.table else "")
    )


if __name__ == "__main__":
    main()
