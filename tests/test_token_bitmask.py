"""Grammar bitmasks applied to logits: the Triton kernel (interpreted without a GPU) and the sampler's CPU
path against a per-token reference, on random masks, vocabularies that end inside a word, masks wider
than the vocabulary (a padded vocabulary) and rows that allow everything."""

from __future__ import annotations

import os

import pytest
import torch

# The interpreter is chosen when the kernel is decorated, so this must precede the import below.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ember.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref
from ember.sampling.sampler import apply_token_bitmask as sampler_apply

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (rows, vocab, mask words): a vocabulary ending inside a word, one ending on a word boundary, a mask
# wider than the vocabulary, and more tokens than one kernel block.
SHAPES = [(3, 32 * 7 + 5, 8), (2, 64, 2), (4, 100, 6), (3, 9000, 290)]


def _random_bitmask(rows: int, words: int, gen: torch.Generator) -> torch.Tensor:
    """Random words, with row 0 all ones (an unconstrained row) and a sparse row (most tokens banned, as
    a JSON grammar's masks are)."""
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    bitmask[0] = -1
    bitmask[-1] &= torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, generator=gen)
    bitmask[-1] &= torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, generator=gen)
    return bitmask


def _per_token(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    expected = logits.clone()
    for row in range(logits.shape[0]):
        words = [int(w) for w in bitmask[row]]
        for token in range(logits.shape[1]):
            if not (words[token // 32] >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    return expected


def test_reference_is_bit_by_bit():
    gen = torch.Generator().manual_seed(0)
    bitmask = _random_bitmask(3, 8, gen)
    logits = torch.randn(3, 32 * 7 + 5, generator=gen)
    assert torch.equal(apply_token_bitmask_ref(logits.clone(), bitmask), _per_token(logits, bitmask))


@pytest.mark.parametrize("rows,vocab,words", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(rows, vocab, words, dtype):
    gen = torch.Generator().manual_seed(rows * vocab)
    bitmask = _random_bitmask(rows, words, gen)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    expected = apply_token_bitmask_ref(logits.clone(), bitmask)
    out = apply_token_bitmask(logits.to(DEVICE), bitmask.to(DEVICE))
    assert torch.equal(out.cpu(), expected)
    assert torch.equal(out[0].cpu(), logits[0])  # an all-ones row is left as it was


@pytest.mark.parametrize("rows,vocab,words", SHAPES)
def test_sampler_cpu_path_matches_reference(rows, vocab, words):
    gen = torch.Generator().manual_seed(rows + vocab)
    bitmask = _random_bitmask(rows, words, gen)
    logits = torch.randn(rows, vocab, generator=gen)
    expected = apply_token_bitmask_ref(logits.clone(), bitmask)
    out = sampler_apply(logits, bitmask)
    assert out is logits and torch.equal(out, expected)  # in place


def test_kernel_works_on_row_slices():
    """Rows of a larger tensor (a row stride that is not the vocabulary) are masked where they lie."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(3, 200, generator=gen)
    bitmask = _random_bitmask(3, 4, gen)
    expected = base.clone()
    apply_token_bitmask_ref(expected[:, :100], bitmask)
    out = base.to(DEVICE)
    apply_token_bitmask(out[:, :100], bitmask.to(DEVICE))
    assert torch.equal(out.cpu(), expected)


def test_kernel_rejects_a_short_or_wrong_mask():
    logits = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_token_bitmask(logits, torch.zeros(2, 3, dtype=torch.int32))  # 96 bits for 100 tokens
    with pytest.raises(ValueError, match="bitmask must be int32"):
        apply_token_bitmask(logits, torch.zeros(2, 4, dtype=torch.int64))
