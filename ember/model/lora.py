"""LoRA on a loaded decoder: each adaptable projection wrapped so that its output gains its rows' adapter
deltas, the adapters' slot tensors, and the reading of a PEFT adapter's tensors into a slot.

The wrapped projections are q/k/v (the fused qkv_proj, three slices), o_proj, gate/up (the fused
gate_up_proj, two slices) and down_proj of dense MLPs; which adapter each row runs under is one int32
per token in `slots`, a step input the runner fills (ember/runner/lora_manager.py) and every layer
reads through the same tensor (`LoRABatch`), so a CUDA graph captured on it replays any mix of adapters.

The embedding's and the LM head's adapters (`LoRAEmbedding`, `LoRAHead`) are called by the model
itself (`DecoderModel.embed_lora`, `CausalLM.lora_head`), since neither is a plain projection's forward:
the embedding's delta goes in before Gemma's sqrt(hidden) scale (PEFT scales it too), and the LM head's
is added to the logits of the rows sampled, whose slots the runner picks the way it picks their hidden
rows (`compute_logits(hidden[rows], slots[rows])`), whether the head is tied to the embedding or not.
Their slots are always built with LoRA on, vocabulary-sized: A [max_loras, rank, vocab] for the
embedding and B [max_loras, rank, vocab] for the head, 2 * max_loras * max_lora_rank * vocab values
(33 MB at bf16 for 4 rank-16 slots of a 128k vocabulary, a tenth of Llama-3-8B's 335 MB of projection slots).
Building them only once an adapter needs them would leave the CUDA graphs captured with the LoRA deltas
without the embedding's, or recapturing them; a step whose adapters have neither skips both deltas when it
runs eagerly, and a step of the base alone replays graphs captured without any delta.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn

from ember.cpu_native import ops as native
from ember.lora.peft import EMBED, HEAD, TARGETS, LoRAShapes, PeftAdapter
from ember.model.layers import GatedMLP
from ember.model.llama import Attention, CausalLM
from ember.ops import registry
from ember.ops.linear_native import native_expand_min_rows
from ember.ops.lora import FusedShrink, LoRAWeights, NativeLoRA, TritonLoRA, stacked_slices
from ember.ops.target import Target

# The most A rows (max_loras * n_slices * max_lora_rank) a dense base's GEMM takes on (`FusedShrink`), as a
# fraction of its output columns. The fused GEMM reads every slot's A and computes every slot's shrink for
# every row, where the shrink kernel reads only the rows' own slots': worth a launch saved while that is a
# few percent of the base's bytes (8 rank-16 slots on Llama-3-8B: 2% of a layer's weights), not once A
# grows toward W's size (64 rank-64 slots of a 4096-wide o_proj: 4096 rows, a GEMM twice as long).
FUSED_SHRINK_MAX_ROWS = 0.125


@dataclass
class LoRABatch:
    """What every wrapped projection reads of the step: `slots`, each token's adapter slot (-1: none), a
    runner buffer that is never replaced (a CUDA graph captured on it replays any mix), and `active`,
    whether any row of an eager step has an adapter (a step of the base alone skips the deltas; while
    graphs are captured, on for the set that holds them and off for the base's, `LoRALayers.capturing`)."""

    slots: torch.Tensor
    active: bool = True
    embed: bool = True  # whether any of them has an embedding adapter (eager steps skip it otherwise)
    head: bool = True  # whether any has an LM-head adapter (the runner passes no slots to the head otherwise)


class LoRALinear(nn.Module):
    """base(x) plus, for each row t, the delta of the adapter in slot slots[t] (none for -1). The base keeps
    its own kernels (dense or quantized). On CPU the fused native paths that skip `forward` keep running:
    the whole-layer decode (ops.decode_layer) reads the base's native weight and `native_lora`, and runs
    each GEMV and its delta in one parallel region (gemv_lora), as `forward` does where the base is the
    native GEMV for its rows (else the base, then NativeLoRA's delta: the same numbers); GEMV + SiLU is the
    base's where no row has an adapter, else `forward` then the same native SiLU."""

    def __init__(
        self, base: nn.Module, weights: LoRAWeights, batch: LoRABatch, target: Target, fused: FusedShrink | None
    ) -> None:
        """`target`: the model's device and activations' dtype. `fused`: the base's weight with the slots' A
        under it (`weights.a` its view, `base` a view of the rest), whose one GEMM computes the shrink too
        (`_with_fused_shrink`)."""
        super().__init__()
        self.base = base
        self.weights = weights
        self.batch = batch
        self.fused_shrink = fused
        self._impl = registry.lora_impl(target)
        gemv = self.native_gemv_weight()
        self._silu_rows = 0 if gemv is None else native_expand_min_rows(gemv)  # rows the native SiLU takes

    def native_gemv_parts(self) -> tuple[native.NativeWeight, torch.Tensor | None] | None:
        """The base's (QuantLinear.native_gemv_parts): `forward` adds the LoRA delta to them, so a fused
        caller adds `native_lora`'s too (ops.decode_layer does)."""
        parts = getattr(self.base, "native_gemv_parts", None)
        return None if parts is None else parts()

    def native_gemv_weight(self) -> native.NativeWeight | None:
        """The base's, as `native_gemv_parts`."""
        gemv = getattr(self.base, "native_gemv_weight", None)
        return None if gemv is None else gemv()

    def native_lora(self) -> tuple[native.LoRASlots, LoRABatch] | None:
        """The slots as the native kernels take them and the batch whose `slots` give each row's, for the
        fused decode; None where the kernels do not take them."""
        w = self.weights
        return ((w.a, w.b), self.batch) if native.lora_fits(w.a, w.b) else None

    def native_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this (gate/up) projection's output with the native SiLU where the base's
        native GEMV takes x (as QuantLinear.native_silu_and_mul, so a row's numbers are the fused decode's);
        else None."""
        if not self.batch.active:
            return cast(Any, self.base).native_silu_and_mul(x)  # a QuantLinear: `native_gemv_weight` was not None
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[0] >= self._silu_rows:
            return None
        return native.silu_mul(self(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch.active and self.fused_shrink is not None:
            return self._with_fused_shrink(x)
        if self.batch.active and isinstance(self._impl, NativeLoRA) and x.dim() == 2:
            y = self._fused(x)
            if y is not None:
                return y
        y = self.base(x)
        if self.batch.active:
            rows = x.reshape(-1, x.shape[-1])
            self._impl(rows, y.view(-1, y.shape[-1]), self.weights, self.batch.slots[: rows.shape[0]])
        return y

    def _with_fused_shrink(self, x: torch.Tensor) -> torch.Tensor:
        """The base GEMM that computes every slot's shrink too, then one expand launch for every slice. The
        output is a view of the GEMM's, its rows strided (the kernels reading projections' outputs take
        row strides: rotary and KV store, SiLU, the norms)."""
        assert self.fused_shrink is not None
        rows = x.reshape(-1, x.shape[-1])
        y, xa = self.fused_shrink(rows)
        TritonLoRA.expand_slots(xa, y, self.weights, self.batch.slots[: rows.shape[0]])
        return y.unflatten(0, x.shape[:-1])

    def _fused(self, x: torch.Tensor) -> torch.Tensor | None:
        """The base's native GEMV (+ bias) and NativeLoRA's delta in one call whose parallel region runs both
        (ops.matmul_lora: the numbers of `base(x)` then the delta, and of the fused decode), where the base
        is that GEMV for x's rows; else None."""
        parts = self.native_gemv_parts()
        w = self.weights
        if (
            parts is None
            or x.dtype != torch.float32
            or not x.is_contiguous()
            or x.shape[0] >= native_expand_min_rows(parts[0])
            or not native.lora_fits(w.a, w.b)
            or w.offsets[-1] + w.b[-1].shape[2] != parts[0].out_features
        ):
            return None
        return native.matmul_lora(x, parts[0], parts[1], (w.a, w.b), self.batch.slots[: x.shape[0]])


class LoRAEmbedding:
    """Adds each token's embedding-adapter delta, B[s] @ A[s][:, id], to the base embedding's rows in place."""

    def __init__(self, weights: LoRAWeights, batch: LoRABatch, target: Target) -> None:
        self.weights = weights
        self.batch = batch
        self._impl = registry.lora_impl(target)

    def __call__(self, input_ids: torch.Tensor, h: torch.Tensor) -> None:
        if self.batch.active and self.batch.embed:
            ids = input_ids.reshape(-1)
            self._impl.embed(ids, h.view(-1, h.shape[-1]), self.weights, self.batch.slots[: ids.shape[0]])


class LoRAHead:
    """Adds the LM-head adapter's delta to logits [N, vocab] of hidden rows [N, hidden], row n under slot
    slots[n] (the sampled rows' own, gathered by the caller)."""

    def __init__(self, weights: LoRAWeights, target: Target) -> None:
        self.weights = weights
        self._impl = registry.lora_impl(target)

    def __call__(self, hidden: torch.Tensor, logits: torch.Tensor, slots: torch.Tensor) -> None:
        self._impl(hidden, logits, self.weights, slots)


@dataclass
class _Slices:
    """A wrapped module's slices: each PEFT module's slice index and output width."""

    in_features: int
    widths: list[int]


def _modules(model: CausalLM) -> dict[str, _Slices]:
    """Ember module suffix -> its slices, for the projections every decoder layer has (MoE MLPs have none)."""
    cfg, attn = model.config, model.attention_layers()[0]
    if not isinstance(attn, Attention):
        raise ValueError(f"LoRA adapters are not supported for {cfg.architecture} (multi-head latent attention)")
    hidden, q, kv = cfg.hidden_size, attn.q_size, attn.kv_size
    modules = {"self_attn.qkv_proj": _Slices(hidden, [q, kv, kv]), "self_attn.o_proj": _Slices(q, [hidden])}
    mlps = [layer.mlp for layer in model.model.decoder_layers()]
    if all(isinstance(m, GatedMLP) for m in mlps):
        inter = model.layout.intermediate_size
        modules["mlp.gate_up_proj"] = _Slices(hidden, [inter, inter])
        modules["mlp.down_proj"] = _Slices(inter, [hidden])
    return modules


class LoRALayers:
    """The model's wrapped projections and their slot tensors; `install` puts an adapter's weights in a slot."""

    def __init__(
        self, model: CausalLM, max_loras: int, max_rank: int, slots: torch.Tensor, lora_dtype: str = "auto"
    ) -> None:
        """`lora_dtype`: the slots' (`slot_dtype`)."""
        if model.layout.size > 1:
            raise ValueError("enable_lora: not supported with tensor parallelism yet")
        modules = _modules(model)
        device = slots.device
        target = registry.target(device, model.model.norm.weight.dtype)
        dtype = slot_dtype(lora_dtype, target)
        self.max_rank = max_rank
        self.batch = LoRABatch(slots)
        self.weights: dict[tuple[int, str], LoRAWeights] = {}
        for index, layer in enumerate(model.model.decoder_layers()):
            for suffix, sl in modules.items():
                parent_name, attr = suffix.split(".")
                parent = getattr(layer, parent_name)
                base = getattr(parent, attr)
                fused = _fused_shrink(base, max_loras * len(sl.widths) * max_rank)
                a = None if fused is None else fused.a(max_loras)
                w = _weights(max_loras, max_rank, sl.in_features, sl.widths, dtype, device, a)
                self.weights[index, suffix] = w
                setattr(parent, attr, LoRALinear(base, w, self.batch, target, fused))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the weights moved into FusedShrink's buffers: the KV sizing counts held memory
        model.choose_kernels()  # the native fused paths take the wrapped projections' deltas
        vocab, hidden = model.config.vocab_size, model.config.hidden_size
        self.embed = _weights(max_loras, max_rank, vocab, [hidden], dtype, device)
        self.head = _weights(max_loras, max_rank, hidden, [vocab], dtype, device)
        model.model.embed_lora = LoRAEmbedding(self.embed, self.batch, target)
        model.lora_head = LoRAHead(self.head, target)
        self._outer = {EMBED: self.embed, HEAD: self.head}
        self._holds: list[set[str]] = [set() for _ in range(max_loras)]  # per slot: embed_tokens, lm_head
        peft = {name: (suffix, i) for name, (suffix, i) in TARGETS.items() if suffix in modules}
        self.shapes = LoRAShapes(
            max_loras,
            max_rank,
            model.config.num_hidden_layers,
            {
                **{name: [modules[s].in_features, modules[s].widths[i]] for name, (s, i) in peft.items()},
                EMBED: [vocab, hidden],
                HEAD: [hidden, vocab],
            },
        )

    def read(self, adapter: PeftAdapter) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """The adapter's (A [r, in], scale * B^T [r, out]) per (layer, PEFT module), in the slots' dtype, on
        the host: what `install` copies (read on a loader thread, off the engine's loop)."""
        dtype = self.embed.a.dtype
        out = {}
        with safe_open(adapter.weights_file, framework="pt") as f:
            for key, (a_name, b_name) in adapter.modules.items():
                a, b = f.get_tensor(a_name).float(), f.get_tensor(b_name).float()
                out[key] = (a.to(dtype), (b.T * adapter.scale).to(dtype).contiguous())
        return out

    def install(self, slot: int, tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make `slot` hold these tensors (from `read`), zeros everywhere they do not reach."""
        for w in [*self.weights.values(), self.embed, self.head]:
            w.a[slot].zero_()
            for b in w.b:
                b[slot].zero_()
        self._holds[slot] = set()
        for (layer, module), (a, bt) in tensors.items():
            if layer < 0:  # embed_tokens or lm_head
                w, i = self._outer[module], 0
                self._holds[slot].add(module)
            else:
                suffix, i = TARGETS[module]
                w = self.weights[layer, suffix]
            r = a.shape[0]
            w.a[slot, i * self.max_rank : i * self.max_rank + r].copy_(a, non_blocking=True)
            w.b[i][slot, :r].copy_(bt, non_blocking=True)

    def use(self, slots: set[int]) -> None:
        """The slots the next step's rows use: which deltas an eager step runs."""
        self.batch.active = bool(slots)
        self.batch.embed = any(EMBED in self._holds[s] for s in slots)
        self.batch.head = any(HEAD in self._holds[s] for s in slots)

    @contextmanager
    def capturing(self, lora: bool) -> Iterator[None]:
        """Every delta, the embedding's included, or none (`lora` False), whatever the slots hold, while
        inside: what a CUDA graph captured there runs at each replay. Then the flags are as before."""
        b = self.batch
        before = (b.active, b.embed, b.head)
        b.active = b.embed = b.head = lora
        try:
            yield
        finally:
            b.active, b.embed, b.head = before


def slot_dtype(name: str, target: Target) -> torch.dtype:
    """The adapters' dtype in their slots (vLLM's `--lora-dtype`): "auto" is the model's. Another runs where
    the slots' deltas are summed in the activations' dtype whatever theirs: on the CPU, natively for
    bfloat16 slots under float32 activations (half the memory: four rank-16 adapters of the default model
    in 39 MB instead of 78), through PyTorch's ops otherwise. The GPU's kernels take the model's dtype.
    Halving the bytes did not change the CPU's tok/s over four adapters measurably (0.822-0.851x of the
    LoRA-on engine's base-only rounds, float32 0.822-0.828x, 2-core EPYC, 2026-12-07): the delta's time
    there is its arithmetic and its calls, not its reads."""
    if name == "auto":
        return target.dtype
    dtype = cast(torch.dtype, getattr(torch, name))
    if dtype != target.dtype and not target.cpu:
        device = target.device.type
        raise ValueError(f"lora_dtype: adapters on {device} run in the model's dtype ({target.dtype}), got {name}")
    return dtype


def _weights(
    max_loras: int,
    max_rank: int,
    in_features: int,
    widths: list[int],
    dtype: torch.dtype,
    device: torch.device,
    a: torch.Tensor | None = None,
) -> LoRAWeights:
    """Zeroed slots of a projection in_features -> sum(widths), a slice per width; `a`: A's zeroed slots
    where they are already laid out (FusedShrink.a)."""
    return LoRAWeights(
        torch.zeros(max_loras, len(widths) * max_rank, in_features, dtype=dtype, device=device) if a is None else a,
        stacked_slices(max_loras, max_rank, widths, dtype, device),
        [sum(widths[:i]) for i in range(len(widths))],
    )


def _fused_shrink(base: nn.Module, a_rows: int) -> FusedShrink | None:
    """Where the GPU path runs the delta (TritonLoRA) and the base is dense (an nn.Linear of bf16, fp16 or
    fp32), `base`'s weight and bias moved into a FusedShrink with `a_rows` zero rows of A under them, `base`
    keeping views of its own (so it computes as before, for steps of the base alone); else None.

    Not where A outgrows FUSED_SHRINK_MAX_ROWS, nor for a quantized base (int4/int8/fp8, GGUF): its GEMM
    reads W in its own format, so the A rows would have to be quantized alike or run as a second GEMM,
    which the shrink kernel already is. Tensor parallelism (not yet with LoRA) keeps the layout: a
    column-parallel layer (q/k/v, gate/up) splits W's rows and would hold A whole (B's columns cut as W's
    rows); a row-parallel one (o, down) splits K, W's and A's alike, so its GEMM gives a partial shrink,
    and the delta of that partial through the whole B, added before the all-reduce that sums the base's
    partial outputs, sums to the delta of the whole shrink (B is linear), as vLLM's row-parallel LoRA
    layers compute it."""
    if not isinstance(base, nn.Linear) or base.weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    w = base.weight
    if a_rows > FUSED_SHRINK_MAX_ROWS * w.shape[0] or not isinstance(
        registry.lora_impl(registry.target(w.device, w.dtype)), TritonLoRA
    ):
        return None
    fused = FusedShrink.stack(w.detach(), None if base.bias is None else base.bias.detach(), a_rows)
    for name, view in (("weight", fused.base_weight), ("bias", fused.base_bias)):
        if view is not None:
            setattr(base, name, nn.Parameter(view, requires_grad=False))
    return fused
