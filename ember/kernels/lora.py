"""LoRA shrink and expand over a per-row adapter slot index, in a segmented form for batches of many rows
(prefill, decode at large batch) and a gathered form for decode-sized ones.

`lora_shrink`: xa[t] = A[slots[t]] @ x[t], every slice's rank columns at once, in float32.
`lora_expand`: y[t, off_i:off_i + out_i] += B_i[slots[t]] @ xa[t, slice i's columns] for every slice i
(q/k/v, gate/up) in one launch, rounded once into y: a program whose columns span slices walks each
slice's part of them with that slice's B and rank columns. `lora_expand_slots`: the same from
every slot's shrink of each row side by side, each row reading its own slot's: the tail of a dense base
GEMM run over [W ; A] (ember.ops.lora.FusedShrink), so where the base is dense no shrink kernel runs.

The gathered form (punica's BGMV): a program per row and tile of output columns reads only that row's
slot's weights, on CUDA cores. A 512-token prefill under one adapter so re-reads the adapter's weights
512 times and uses no tensor cores. The segmented form (SGMV-like, without a host-side segment table): a
program per tile of SEGMENT_ROWS consecutive rows and tile of columns walks the adapters its rows use,
one `tl.dot` each against that slot's weights with the other rows masked out, so each slot's weights are
read once a tile; rows of the base (-1) add nothing. A request's prefill tokens are contiguous, and the
runner puts a step's decode rows in slot order (ember/runner/step_inputs.py), so nearly every tile has
one adapter and a tile where runs meet two. Batches under SEGMENTED_MIN_ROWS rows (decode at small batch)
run the gathered kernel alone; larger ones the segmented kernel alone.

At 256 decode rows of the 8B shape over 8 rank-16 adapters dealt round-robin, the earlier split (a tile
of one slot segmented, a mixed tile's rows gathered, a program each re-reading its slot's B from L2)
left every tile mixed, most of the delta on CUDA cores: the adapters ran at 0.61x the base's tok/s (H100,
2026-12-07).

Both forms read the slots on the device (each program its own row's or tile's), so one captured CUDA graph serves
every mix of adapters. The shrink splits K when its rows and column tiles are few (`_split_k`). So a
decode step's delta is four launches a layer with a dense base (an expand a projection) or eight with a
quantized one (one form each), where it was eleven (a shrink a projection, an expand a slice): at batch 1
the launches, a few microseconds each, are most of what an adapter costs (docs/lora.md, Measured).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from ember.kernels.paged import dot_dtype, dot_precision

SEGMENT_ROWS = 32  # the segmented kernels' BLOCK_M: rows sharing one read of their adapter's weights
SEGMENTED_MIN_ROWS = 64  # fewer rows: the gathered kernels alone
SHRINK_BLOCK_K = 64
SPLIT_K_PROGRAMS = 264  # two per SM of an H100/H200
SPLIT_K_MIN_COLUMNS = 256
# The gathered expand's programs: a row's columns are spread over up to this many / rows programs, each
# walking its share tile by tile. A program per row and 128-column tile was 86k programs a layer at 256
# decode rows of the 8B shape, most of them rows without an adapter that only exit, and LoRA turned on cost
# requests using none 35% of their throughput (H100, 2026-12-06).
EXPAND_PROGRAMS = 1056
NO_SLOT: tl.constexpr = tl.constexpr(1 << 30)  # above every slot: a row past the batch's end, or none left


@triton.jit
def _row_slots(slots_ptr, rows, T):
    """The slots of a tile's rows, NO_SLOT past T."""
    return tl.load(slots_ptr + rows, mask=rows < T, other=NO_SLOT)


@triton.jit
def _next_slot(tile_slots, after):
    """The smallest adapter slot above `after` among the tile's rows (NO_SLOT where none is): called from
    -1, the adapters a tile uses in ascending order, the base's rows skipped."""
    return tl.min(tl.where(tile_slots > after, tile_slots, NO_SLOT))


@triton.jit
def _k_range(split, K, K_CHUNK, work):
    """The input columns [begin, end) of split-K part `split`; an empty range where there is no `work`."""
    begin = split * K_CHUNK
    return begin, tl.where(work, tl.minimum(begin + K_CHUNK, K), begin)


@triton.jit
def _sum_splits(ptrs, mask, SPLITS, stride_s, work):
    """The shrink at `ptrs` in float32: its split-K partial sums added in split order (the same sum whatever
    the batch), or the fused base GEMM's one part (SPLITS 1, in the GEMM's dtype); only the first part read
    without `work`."""
    xa = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    for s in range(1, tl.where(work, SPLITS, 1)):
        xa += tl.load(ptrs + s * stride_s, mask=mask, other=0.0)
    return xa


@triton.jit
def _shrink_gathered_kernel(
    x_ptr, a_ptr, slots_ptr, out_ptr, T, K, N, K_CHUNK, stride_xt, stride_as, stride_an, stride_ot, stride_os,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    k_begin, k_end = _k_range(tl.program_id(2), K, K_CHUNK, slot >= 0)  # no adapter: writes zeros
    a_rows = a_ptr + tl.maximum(slot, 0) * stride_as + cols[:, None] * stride_an
    out_ptr += tl.program_id(2).to(tl.int64) * stride_os
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xt + ks, mask=ks < K, other=0.0).to(tl.float32)
        a = tl.load(a_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + row * stride_ot + cols, acc, mask=cols < N)


@triton.jit
def _shrink_segments_kernel(
    x_ptr, a_ptr, slots_ptr, out_ptr, T, K, N, K_CHUNK, stride_xt, stride_as, stride_an, stride_ot, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tile_slots = _row_slots(slots_ptr, rows, T)
    k_begin, k_end = _k_range(tl.program_id(2), K, K_CHUNK, True)
    x_rows = x_ptr + rows[:, None] * stride_xt
    out_ptr += tl.program_id(2).to(tl.int64) * stride_os
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the base's rows keep zeros
    slot = _next_slot(tile_slots, -1)
    while slot < NO_SLOT:
        own = tile_slots == slot
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + cols[:, None] * stride_an
        for k0 in range(k_begin, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + ks[None, :], mask=own[:, None] & (ks[None, :] < K), other=0.0)
            a = tl.load(a_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
            acc = tl.dot(x.to(DOT_DTYPE), tl.trans(a.to(DOT_DTYPE)), acc, input_precision=PRECISION)
        slot = _next_slot(tile_slots, slot)
    mask = (rows[:, None] < T) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :], acc, mask=mask)


@triton.jit
def _expand_row_slice(
    xa_row, b_ptr, y_row, slot, c_begin, c_end, lo, hi, b_start, xa_col, R, SPLITS, stride_xap,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The gathered expand of one row's columns [c_begin, c_end) that fall in the slice of output columns
    [lo, hi): its B [slots, R, hi - lo] at b_ptr + b_start (`stacked_slices`), its input the R columns of
    the row's shrink from xa_col. Tile by tile, each a contiguous run of one slice's B row."""
    begin = tl.maximum(c_begin, lo)
    end = tl.minimum(c_end, hi)
    rs = tl.arange(0, BLOCK_R)
    xa = _sum_splits(xa_row + xa_col + rs, rs < R, SPLITS, stride_xap, end > begin)
    b_rows = b_ptr + b_start + (tl.maximum(slot, 0) * R + rs[:, None]) * (hi - lo) - lo  # + an output column
    for c0 in range(begin, end, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = cols < end
        b = tl.load(b_rows + cols[None, :], mask=(rs[:, None] < R) & mask[None, :], other=0.0)
        delta = tl.sum(xa[:, None] * b.to(tl.float32), axis=0)
        y = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, (y + delta).to(y_row.dtype.element_ty), mask=mask)


@triton.jit
def _expand_gathered_kernel(
    xa_ptr, b_ptr, slots_ptr, y_ptr, T, R, N, END0, END1, B_START1, B_START2, SPLITS, stride_xap, stride_xat,
    stride_xas, stride_yt, COLUMNS, N_SLICES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    # this program's COLUMNS output columns, across slices; none for a row without an adapter (it reads and
    # writes nothing)
    c_begin = tl.program_id(1) * COLUMNS
    c_end = tl.minimum(c_begin + COLUMNS, tl.where(slot >= 0, N, 0))
    xa_row = xa_ptr + row * stride_xat + tl.maximum(slot, 0) * stride_xas  # the row's own slot's shrink
    y_row = y_ptr + row * stride_yt
    _expand_row_slice(
        xa_row, b_ptr, y_row, slot, c_begin, c_end, 0, END0, 0, 0, R, SPLITS, stride_xap, BLOCK_R, BLOCK_N
    )
    if N_SLICES > 1:
        _expand_row_slice(
            xa_row, b_ptr, y_row, slot, c_begin, c_end, END0, END1, B_START1, R, R, SPLITS, stride_xap, BLOCK_R,
            BLOCK_N,
        )  # fmt: skip
    if N_SLICES > 2:
        _expand_row_slice(
            xa_row, b_ptr, y_row, slot, c_begin, c_end, END1, N, B_START2, 2 * R, R, SPLITS, stride_xap, BLOCK_R,
            BLOCK_N,
        )  # fmt: skip


@triton.jit
def _segment_slice(
    delta, xa_tile, xa_mask, b_ptr, slot, cols, live, lo, hi, b_start, xa_col, R, SPLITS, stride_xap,
    BLOCK_R: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """delta plus the segmented expand of the tile's columns in the slice of output columns [lo, hi) (B and
    xa's columns as `_expand_row_slice`'s); nothing read where the tile has none of them."""
    ours = live & (cols >= lo) & (cols < hi)
    any_ours = tl.max(ours.to(tl.int32)) > 0
    if any_ours:
        rs = tl.arange(0, BLOCK_R)
        xa = _sum_splits(xa_tile + xa_col, xa_mask, SPLITS, stride_xap, any_ours)
        b_rows = b_ptr + b_start + (tl.maximum(slot, 0) * R + rs[:, None]) * (hi - lo) - lo
        b = tl.load(b_rows + cols[None, :], mask=(rs[:, None] < R) & ours[None, :], other=0.0)
        delta = tl.dot(xa.to(DOT_DTYPE), b.to(DOT_DTYPE), delta, input_precision=PRECISION)
    return delta


@triton.jit
def _expand_segments_kernel(
    xa_ptr, b_ptr, slots_ptr, y_ptr, T, R, N, END0, END1, B_START1, B_START2, SPLITS, stride_xap, stride_xat,
    stride_xas, stride_yt, N_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tile_slots = _row_slots(slots_ptr, rows, T)
    live = cols < N
    rs = tl.arange(0, BLOCK_R)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    slot = _next_slot(tile_slots, -1)
    while slot < NO_SLOT:  # each adapter of the tile's rows: its B read once, the other rows' xa masked to zeros
        xa_mask = (tile_slots == slot)[:, None] & (rs[None, :] < R)
        s64 = slot.to(tl.int64)
        xa_tile = xa_ptr + rows[:, None] * stride_xat + s64 * stride_xas + rs[None, :]
        # a tile's columns are of one slice but where slices meet: there each slice's product, the others'
        # columns masked to exact zeros
        delta = _segment_slice(
            delta, xa_tile, xa_mask, b_ptr, s64, cols, live, 0, END0, 0, 0, R, SPLITS, stride_xap, BLOCK_R,
            DOT_DTYPE, PRECISION,
        )  # fmt: skip
        if N_SLICES > 1:
            delta = _segment_slice(
                delta, xa_tile, xa_mask, b_ptr, s64, cols, live, END0, END1, B_START1, R, R, SPLITS, stride_xap,
                BLOCK_R, DOT_DTYPE, PRECISION,
            )  # fmt: skip
        if N_SLICES > 2:
            delta = _segment_slice(
                delta, xa_tile, xa_mask, b_ptr, s64, cols, live, END1, N, B_START2, 2 * R, R, SPLITS, stride_xap,
                BLOCK_R, DOT_DTYPE, PRECISION,
            )  # fmt: skip
        slot = _next_slot(tile_slots, slot)
    y_tile = y_ptr + rows[:, None] * stride_yt + cols[None, :]
    mask = ((tile_slots >= 0) & (tile_slots < NO_SLOT))[:, None] & live[None, :]  # the base's rows left alone
    y = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_tile, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _segment_rows(rows: int) -> int:
    """The segmented kernels' tile height for a batch of `rows`, or 0 where the gathered kernels run instead:
    a decode-sized batch has few rows a tile to share its weight reads."""
    return SEGMENT_ROWS if rows >= SEGMENTED_MIN_ROWS else 0


def _tile(n: int, cap: int = 1 << 30) -> int:
    """A power-of-two tile covering n (up to `cap`), at least tl.dot's 16: a rank-8 slot's columns masked."""
    return max(16, min(cap, triton.next_power_of_2(n)))


def _split_k(programs: int, k: int) -> tuple[int, int]:
    """(parts, input columns per part) of a shrink whose rows and column tiles make `programs` programs.

    The shrink's output is only n_slices * rank wide, so without splitting K a decode row's whole product is
    one or three programs, each walking all of K alone: 8B batch-1 decode took 15.8 ms a token with one
    rank-16 adapter against 6.1 ms without (H100, 2026-12-06), most of it four such walks a layer. Split
    until about SPLIT_K_PROGRAMS programs run, each part at least SPLIT_K_MIN_COLUMNS wide; the expand adds
    the parts in a fixed order, so a row's result does not depend on its batch."""
    parts = max(1, min(triton.cdiv(SPLIT_K_PROGRAMS, programs), k // SPLIT_K_MIN_COLUMNS))
    chunk = triton.cdiv(triton.cdiv(k, parts), SHRINK_BLOCK_K) * SHRINK_BLOCK_K
    return triton.cdiv(k, chunk), chunk


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [slots, N, K] (contiguous rows), slots [T] -> float32 [parts, T, N]: row t's A @ x[t]
    (zeros for slot -1) as split-K partial sums, which `lora_expand` adds."""
    rows, k = x.shape
    n = a.shape[1]
    block_m, block_n = _segment_rows(rows), _tile(n, 64)
    parts, chunk = _split_k(triton.cdiv(rows, block_m or 1) * triton.cdiv(n, block_n), k)
    out = torch.empty(parts, rows, n, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    args = (x, a, slots, out, rows, k, n, chunk, x.stride(0), a.stride(0), a.stride(1), out.stride(1), out.stride(0))
    if block_m:
        _shrink_segments_kernel[(triton.cdiv(rows, block_m), triton.cdiv(n, block_n), parts)](
            *args, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=SHRINK_BLOCK_K, DOT_DTYPE=dot_dtype(x.dtype),
            PRECISION=dot_precision(x.dtype),
        )  # fmt: skip
    else:
        _shrink_gathered_kernel[(rows, triton.cdiv(n, block_n), parts)](*args, BLOCK_N=block_n, BLOCK_K=SHRINK_BLOCK_K)
    return out


def lora_expand(xa: torch.Tensor, b: list[torch.Tensor], slots: torch.Tensor, y: torch.Tensor) -> None:
    """y[t, :sum N_i] += each slice i's b[i][slots[t]] applied to its R columns of row t's shrink, every slice
    in one launch: xa [parts, T, n_slices * R] is `lora_shrink`'s partial sums (added here), b
    per slice [slots, R, N_i], laid out by `ember.ops.lora.stacked_slices`; rows with slot -1 are left
    alone. The segmented form multiplies in b's dtype (xa rounded to it, as a tensor-core product must), the
    gathered form in float32."""
    _expand(xa, 0, b, slots, y)


def lora_expand_slots(xa: torch.Tensor, b: list[torch.Tensor], slots: torch.Tensor, y: torch.Tensor) -> None:
    """`lora_expand` from xa [T, slots * n_slices * R]: every slot's shrink of each row side by side, as the
    base GEMM fused with the shrink writes them (ember.ops.lora.FusedShrink: its output's tail columns, rows
    strided), each row reading its own slot's."""
    _expand(xa[None], len(b) * b[0].shape[1], b, slots, y)


def _expand(xa: torch.Tensor, slot_stride: int, b: list[torch.Tensor], slots: torch.Tensor, y: torch.Tensor) -> None:
    """The expand over xa [parts, T, ...] in the form for T rows, row t's slice i's R columns at
    slots[t] * slot_stride + i * R."""
    parts, rows = xa.shape[0], xa.shape[1]
    num_slots, r = b[0].shape[0], b[0].shape[1]
    widths = [t.shape[2] for t in b]
    n = sum(widths)
    _check_stacked(b)
    if rows == 0:
        return
    end0, end1 = [*itertools.accumulate(widths), n, n][:2]  # where slices 0 and 1 end (n: no such slice)
    args = (
        xa, b[0], slots, y, rows, r, n, end0, end1, num_slots * r * end0, num_slots * r * end1, parts,
        xa.stride(0), xa.stride(1), slot_stride, y.stride(0),
    )  # fmt: skip
    block_m, block_r, block_n = _segment_rows(rows), _tile(r), _tile(n, 128)
    if block_m:
        _expand_segments_kernel[(triton.cdiv(rows, block_m), triton.cdiv(n, block_n))](
            *args, N_SLICES=len(b), BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n,
            DOT_DTYPE=dot_dtype(b[0].dtype), PRECISION=dot_precision(b[0].dtype),
        )  # fmt: skip
        return
    column_programs = min(triton.cdiv(n, block_n), triton.cdiv(EXPAND_PROGRAMS, rows))
    columns = triton.cdiv(triton.cdiv(n, column_programs), block_n) * block_n
    _expand_gathered_kernel[(rows, triton.cdiv(n, columns))](
        *args, columns, N_SLICES=len(b), BLOCK_R=block_r, BLOCK_N=block_n
    )


def _check_stacked(b: list[torch.Tensor]) -> None:
    """A ValueError unless b's 1 to 3 slices lie one after another in one buffer, each contiguous, as the
    kernels address them (`_expand_row_slice`)."""
    num_slots, r = b[0].shape[0], b[0].shape[1]
    first = 0
    for t in b:
        at = b[0].data_ptr() + first * num_slots * r * t.element_size()
        if not t.is_contiguous() or t.shape[:2] != b[0].shape[:2] or t.dtype != b[0].dtype or t.data_ptr() != at:
            raise ValueError("lora_expand: B's slices must lie one after another in one buffer (stacked_slices)")
        first += t.shape[2]
    if not 1 <= len(b) <= 3:
        raise ValueError(f"lora_expand: 1 to 3 slices, got {len(b)}")


def lora_ref(x: torch.Tensor, a: torch.Tensor, b: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The delta row by row in float64: the tests' reference for both kernels (and TorchLoRA)."""
    rank = b[0].shape[1]
    out = torch.zeros(x.shape[0], sum(t.shape[2] for t in b), dtype=torch.float64, device=x.device)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        xa = a[s].double() @ x[t].double()
        out[t] = torch.cat([xa[i * rank : (i + 1) * rank] @ bi[s].double() for i, bi in enumerate(b)])
    return out
