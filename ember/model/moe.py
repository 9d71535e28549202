"""The mixture-of-experts MLP of Qwen3-MoE, Qwen3-Next, Mixtral, gpt-oss, Llama 4 and DeepSeek: a router and E
gated experts in two tensors (Llama 4, Qwen3-Next and DeepSeek: and a shared expert every token takes;
Llama 4's and DeepSeek's routing in ember/ops/moe.py).

Each token's MLP output is the sum over its top-k experts (by a softmax over all of them, the
top-k weights renormalised to sum to one where the model says so) of weight * down(silu(gate) * up).
gpt-oss adds biases to the router and to each expert's gate/up and down, and replaces silu(gate) * up
by its clamped SwiGLU (`gated_activation`). Qwen3-Next adds a dense "shared expert" MLP that every token
runs, scaled by sigmoid(shared_expert_gate(x)), to the routed experts' sum.

Every expert of a layer lives in one of two stacked tensors, the fused MoE kernels' operands
(ember/kernels/fused_moe.py): `w13` [E, 2I, H] holds each expert's gate rows then its up rows, `w2`
[E, H, I] its down projection; either dense or `QuantizedExperts`. Under tensor parallelism each rank
holds rows start..start+I/n of every expert's gate and up and the same columns of its down
projection, so its output is a partial sum, all-reduced by the decoder layer like a dense MLP's.

Checkpoints store experts one tensor each (`mlp.experts.{e}.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.{e}.w1.weight`), stacked over experts (transformers' in-memory
`mlp.experts.gate_up_proj` / `down_proj`) or, from GGUF, as 3-D `ffn_*_exps` tensors that may be
quantized; `FusedExperts.load` takes every form, cutting each to this rank's slice as it is read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.errors import ModelLoadError
from ember.model.hf_config import ModelConfig
from ember.model.layers import GatedMLP
from ember.model.sharding import ShardLayout, WeightValue, read_shard
from ember.ops import registry
from ember.ops.moe import route_grouped
from ember.quant.experts import QuantizedExperts, dequantize_experts, quantize_experts
from ember.quant.formats import QuantizedWeight, dequantize, same_format

_EXPERTS = ".mlp.experts."
# Mixtral's checkpoint names -> Qwen3-MoE's, which the model's parameters use
_MIXTRAL_NAMES = {
    ".block_sparse_moe.gate.": ".mlp.gate.",
    ".w1.": ".gate_proj.",
    ".w3.": ".up_proj.",
    ".w2.": ".down_proj.",
}
_PARTS = ("gate", "up", "down")
_BIASES = ("gate_bias", "up_bias", "down_bias")


def moe_tensor_name(name: str) -> str:
    """A checkpoint tensor's name in the model's terms: Mixtral's `block_sparse_moe` ones renamed."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.experts.", _EXPERTS)
    for old, new in _MIXTRAL_NAMES.items():
        name = name.replace(old, new)
    return name


def make_mlp(cfg: ModelConfig, layout: ShardLayout, layer: int) -> nn.Module:
    if cfg.layer_is_moe(layer):
        return SparseMoeBlock(cfg, layout, layer)
    return GatedMLP(cfg.hidden_size, layout.intermediate_size, cfg.hidden_act)


class Router(nn.Module):
    """Not an nn.Linear, so `--quantization` leaves it whole: routing decides which experts run at all.
    DeepSeek-V3's `e_score_correction_bias` (float32, as transformers keeps it) shifts its choice only."""

    def __init__(self, num_experts: int, hidden_size: int, bias: bool = False, score_bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts, dtype=torch.float32)) if score_bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias).float()


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: ShardLayout, layer: int) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None, "make_mlp builds it for the layers cfg.layer_is_moe names"
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.routing = moe.routing
        self.grouped = moe.grouped
        self.gate = Router(
            moe.num_experts, cfg.hidden_size, moe.bias, moe.grouped is not None and moe.grouped.score_bias
        )
        self.experts = FusedExperts(moe.num_experts, cfg.hidden_size, layout, layer, moe.bias, moe.swiglu)
        # the fused MoE kernels, or the experts' PyTorch path (ember/ops/moe.py)
        self._moe = registry.moe_impl(registry.target(self.gate.weight.device, self.gate.weight.dtype))
        # Llama 4's, Qwen3-Next's and DeepSeek's shared expert(s) (this rank's rows; DeepSeek's checkpoints name
        # them shared_experts, renamed at load); Qwen3-Next's gate is a Router, so `--quantization` leaves its
        # one row whole
        shared = layout.shared_expert_size
        self.shared_expert = GatedMLP(cfg.hidden_size, shared, cfg.hidden_act) if shared else None
        self.shared_expert_gate = Router(1, cfg.hidden_size) if moe.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the experts' outputs (and the shared expert's), [M, H] in x's dtype."""
        if self.grouped is None:
            out = self._moe(self.experts, x, self.gate(x), self.top_k, self.renormalize, self.routing)
        else:
            weights, ids = route_grouped(
                self.gate(x), self.top_k, self.renormalize, self.grouped, self.gate.e_score_correction_bias
            )
            out = self._moe.routed(self.experts, x, weights, ids)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)).to(x.dtype) * shared
        return out + shared


def _expert(w: torch.Tensor | QuantizedExperts, e: int, dtype: torch.dtype) -> torch.Tensor:
    return w[e] if isinstance(w, torch.Tensor) else dequantize(w.expert(e), dtype)


def gated_activation(gate: torch.Tensor, up: torch.Tensor, swiglu: tuple[float, float] | None) -> torch.Tensor:
    """silu(gate) * up, or gpt-oss's clamped SwiGLU in transformers' order of operations."""
    if swiglu is None:
        return F.silu(gate) * up
    alpha, limit = swiglu
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


class FusedExperts(nn.Module):
    """Every expert of one layer (this rank's slice of each), and the PyTorch path over them."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        layout: ShardLayout,
        layer: int,
        bias: bool = False,
        swiglu: tuple[float, float] | None = None,
    ) -> None:
        super().__init__()
        inter = layout.moe_intermediate_size
        self.num_experts = num_experts
        self.layer = layer
        self.inter = inter
        self.start = layout.rank * inter  # this rank's first intermediate row of each expert
        self.split = layout.size > 1
        self.rank = layout.rank
        self.swiglu = swiglu
        # gpt-oss's biases: b13 [E, 2I] beside w13's rows; b2 [E, H] is added by rank 0 only (the ranks'
        # outputs are summed), the others hold zeros
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * inter)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        # The dense experts are allocated only when something is written to them (`materialize`): a GGUF
        # file's quantized experts replace them unwritten, and Qwen3-30B-A3B's would take 58 GB beside its
        # 17 GB of Q4_K experts. The device is the one the model is built on (under torch.device(...)).
        self._device = torch.empty(0).device
        self.w13: torch.Tensor | QuantizedExperts = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden_size, device="meta")
        )
        self.w2: torch.Tensor | QuantizedExperts = nn.Parameter(
            torch.empty(num_experts, hidden_size, inter, device="meta")
        )
        self._filled: dict[str, set[int]] = {part: set() for part in _PARTS + (_BIASES if bias else ())}
        self._quantized: dict[str, QuantizedExperts] = {}

    def materialize(self) -> None:
        """Allocate the dense experts not allocated yet (random init, float checkpoints, mixed formats)."""
        for attr in ("w13", "w2"):
            w = getattr(self, attr)
            if isinstance(w, nn.Parameter) and w.is_meta:
                setattr(self, attr, nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device=self._device)))

    @staticmethod
    def owns(name: str) -> bool:
        return _EXPERTS in name

    @staticmethod
    def module_name(name: str) -> str:
        return name[: name.index(_EXPERTS) + len(_EXPERTS) - 1]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Tokens grouped by expert (a stable sort of the flattened choices), one gate/up and one down
        matmul per expert that any token chose; quantized experts are dequantized one routed expert at a
        time. Each token's k results are then added in ascending expert order, the order in which
        transformers accumulates them, so float32 results agree bit for bit where the matmuls do."""
        ids, slot = ids.sort(dim=1)
        weights = weights.gather(1, slot)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        tokens = order // ids.shape[1]
        scales = weights.flatten()[order, None]
        results = x.new_empty(flat.shape[0], x.shape[1])  # one row per (token, choice), grouped by expert
        start = 0
        for e, n in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
            if n == 0:
                continue
            rows = slice(start, start + n)
            b13, b2 = (None, None) if self.b13 is None or self.b2 is None else (self.b13[e], self.b2[e])
            gate, up = F.linear(x[tokens[rows]], _expert(self.w13, e, x.dtype), b13).chunk(2, dim=-1)
            act = gated_activation(gate, up, self.swiglu)
            results[rows] = F.linear(act, _expert(self.w2, e, x.dtype), b2) * scales[rows]
            start += n
        per_token = torch.empty_like(results)
        per_token[order] = results
        per_token = per_token.view(*ids.shape, -1)
        out = per_token[:, 0].clone()
        for j in range(1, ids.shape[1]):
            out += per_token[:, j]
        return out

    # ---- loading --------------------------------------------------------------------------

    def load(self, name: str, tensor: WeightValue, source: str) -> None:
        """One checkpoint tensor of these experts: one expert's gate, up or down projection, the same
        stacked over experts (3-D; GGUF's may be quantized), or transformers' stacked gate_up."""
        if name.endswith(".bias"):
            self._load_bias(name, tensor, source)
            return
        key = name[name.index(_EXPERTS) + len(_EXPERTS) :].removesuffix(".weight").split(".")
        expert = int(key[0]) if len(key) == 2 and key[0].isdigit() else None
        proj = key[-1]
        if proj == "gate_up_proj" and len(key) == 1:
            if isinstance(tensor, (QuantizedWeight, QuantizedExperts)):
                raise ModelLoadError(source, f"quantized tensor {name!r}: transformers' stacked gate_up must be dense")
            half = tensor.shape[1] // 2
            for gate_or_up, offset in (("gate", 0), ("up", half)):
                self._load_part(name, gate_or_up, None, tensor.narrow(1, offset + self.start, self.inter), source)
            return
        part = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}.get(proj)
        if part is None or len(key) > 2 or (len(key) == 2 and (expert is None or expert >= self.num_experts)):
            raise ModelLoadError(source, f"unexpected tensor {name!r}")
        dim = (1 if part == "down" else 0) + (1 if expert is None and not isinstance(tensor, QuantizedExperts) else 0)
        self._load_part(
            name, part, expert, read_shard(tensor, (dim, self.start, self.inter) if self.split else None), source
        )

    def _load_bias(self, name: str, tensor: WeightValue, source: str) -> None:
        """Every expert's bias of one projection, stacked: [E, I] for gate and up, [E, H] for down."""
        part = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}.get(name.split(".")[-2])
        if (
            self.b13 is None
            or self.b2 is None
            or part is None
            or not name.endswith(f"{_EXPERTS}{name.split('.')[-2]}.bias")
        ):
            raise ModelLoadError(source, f"unexpected tensor {name!r}")
        if part == "down":
            dest, shard = self.b2.data, None
        else:
            dest = self.b13.data.narrow(1, 0 if part == "gate" else self.inter, self.inter)
            shard = (1, self.start, self.inter) if self.split else None
        bias = read_shard(tensor, shard)
        if not isinstance(bias, torch.Tensor):
            raise ModelLoadError(source, f"quantized tensor {name!r}: the experts' biases must be dense")
        if part == "down" and self.rank:
            bias = torch.zeros_like(bias)
        if tuple(bias.shape) != tuple(dest.shape):
            raise ModelLoadError(source, f"tensor {name!r} has shape {tuple(bias.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(bias)
        self._filled[f"{part}_bias"].update(range(self.num_experts))

    def _load_part(
        self,
        name: str,
        part: str,
        expert: int | None,
        tensor: torch.Tensor | QuantizedWeight | QuantizedExperts,
        source: str,
    ) -> None:
        """Copy this rank's slice into place (rows of gate/up, columns of down), or keep it aside when quantized."""
        dest = self._dest(part, expert)
        if isinstance(tensor, QuantizedExperts):
            if expert is not None or (tensor.num_experts, tensor.out_features, tensor.in_features) != tuple(dest.shape):
                raise ModelLoadError(
                    source,
                    f"quantized tensor {name!r} does not hold every expert in the expected shape {tuple(dest.shape)}",
                )
            self._quantized[part] = tensor.to(self._device)
        elif isinstance(tensor, QuantizedWeight):
            raise ModelLoadError(
                source, f"quantized tensor {name!r}: quantized experts must come stacked, every expert in one tensor"
            )
        else:
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ModelLoadError(
                    source, f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            self.materialize()
            self._dest(part, expert).copy_(tensor)
        self._filled[part].update(range(self.num_experts) if expert is None else (expert,))

    def _dest(self, part: str, expert: int | None) -> torch.Tensor:
        w = self.w2 if part == "down" else self.w13
        assert isinstance(w, torch.Tensor), "written while loading, before finish_loading installs quantized experts"
        dest = w.data if part == "down" else w.data.narrow(1, 0 if part == "gate" else self.inter, self.inter)
        return dest if expert is None else dest[expert]

    def finish_loading(self, source: str) -> None:
        """Check that every expert's three projections arrived, and install quantized ones: w13 stays
        quantized when gate and up arrived in one quantized format, else both are dequantized into it."""
        for part, filled in self._filled.items():
            if len(filled) != self.num_experts:
                missing = sorted(set(range(self.num_experts)) - filled)
                what = part.replace("_", " ") if part in _BIASES else f"{part} projection"
                raise ModelLoadError(
                    source, f"checkpoint is missing the {what} of experts {missing} in layer {self.layer}"
                )
        gate, up = self._quantized.get("gate"), self._quantized.get("up")
        if gate is not None and up is not None and same_format([gate.expert(0), up.expert(0)]):
            self._install("w13", _concat_rows(gate, up))
        else:
            for part, w in ((p, self._quantized.get(p)) for p in ("gate", "up")):
                if w is not None:
                    self.materialize()
                    dest = self._dest(part, None)
                    dest.copy_(dequantize_experts(w, dest.dtype))
        if "down" in self._quantized:
            self._install("w2", self._quantized["down"])
        self._quantized.clear()

    def _install(self, attr: str, w: QuantizedExperts) -> None:
        delattr(self, attr)  # the dense parameter
        setattr(self, attr, w)

    def quantize(self, kind: str) -> None:
        """`--quantization`: dense experts to the load-time quantized form, one tensor at a time."""
        for attr in ("w13", "w2"):
            w = getattr(self, attr)
            if isinstance(w, torch.Tensor):
                self._install(attr, quantize_experts(w.data, kind))

    def weight_tensors(self) -> list[torch.Tensor]:
        """The quantized experts' codes, scales and zeros (dense ones are parameters), for memory accounting."""
        return [
            t
            for w in (self.w13, self.w2)
            if isinstance(w, QuantizedExperts)
            for t in (w.qweight, w.scales, w.zeros)
            if t is not None
        ]


def _concat_rows(a: QuantizedExperts, b: QuantizedExperts) -> QuantizedExperts:
    """Each expert's rows of a, then its rows of b (one format: groups run along K, so this is exact)."""
    # one format (the caller checked same_format): both have zeros or neither has
    zeros = None if a.zeros is None or b.zeros is None else torch.cat([a.zeros, b.zeros], dim=1)
    return QuantizedExperts(
        a.kind,
        torch.cat([a.qweight, b.qweight], dim=1),
        torch.cat([a.scales, b.scales], dim=1),
        zeros,
        a.group_size,
        a.in_features,
    )
