"""The fused sampling kernel (ember/kernels/sampling.py): greedy rows exact, random rows drawn from
softmax(logits / T) (chi-square), the grammar bitmask obeyed, draws fixed by the seed. Without a GPU it
runs in Triton's interpreter on small vocabularies."""

from __future__ import annotations

import os

import torch
from conftest import chi_square_p

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ember.kernels.sampling import sample_race, sample_race_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ALPHA = 1e-3


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[N, V] bool -> llguidance's packing: int32 words, token t at bit t % 32 of word t // 32."""
    n, v = allowed.shape
    padded = torch.zeros(n, -(-v // 32) * 32, dtype=torch.int64)
    padded[:, :v] = allowed.long()
    words = (padded.view(n, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).to(DEV)


def test_greedy_rows_take_the_first_largest_allowed_logit():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 9000, generator=g)  # two chunks of the kernel
    logits[1, [17, 8500]] = 50.0  # a tie across chunks: the first wins, as torch.argmax
    logits[2, [3, 5]] = 50.0  # a tie within a block
    allowed = torch.rand(6, 9000, generator=g) < 0.3
    allowed[1, [17, 8500]] = allowed[2, [3, 5]] = True
    greedy = torch.ones(6, dtype=torch.bool, device=DEV)
    picked = sample_race(logits.to(DEV), greedy, None, seed=1)
    assert picked.tolist() == logits.argmax(1).tolist()
    masked = sample_race(logits.to(DEV), greedy, None, seed=1, bitmask=_bitmask(allowed))
    assert masked.tolist() == logits.masked_fill(~allowed, float("-inf")).argmax(1).tolist()
    assert masked[1] == 17 and masked[2] == 3


def test_random_rows_follow_the_tempered_softmax():
    """Every row is the same distribution, so the rows of one call are independent draws from it; greedy rows
    beside them are unaffected."""
    vocab, n = 7, 800
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    temperature = torch.full((n,), 0.7)
    greedy = torch.zeros(n, dtype=torch.bool)
    greedy[::10] = True
    temperature[greedy] = 1.0
    picked = sample_race(
        base.expand(n, vocab).contiguous().to(DEV), greedy.to(DEV), temperature.to(DEV), seed=1234
    ).cpu()
    assert (picked[greedy] == 0).all()
    drawn = picked[~greedy]
    expected = (torch.softmax(base / 0.7, dim=0) * len(drawn)).tolist()
    assert chi_square_p(torch.bincount(drawn, minlength=vocab).tolist(), expected) > ALPHA
    ref = sample_race_ref(base.expand(n, vocab).contiguous(), greedy, temperature, seed=1234)[~greedy]
    assert chi_square_p(torch.bincount(ref, minlength=vocab).tolist(), expected) > ALPHA


def test_the_bitmask_renormalises_over_the_allowed_tokens():
    vocab, n = 40, 600
    logits = torch.linspace(1.0, -1.0, vocab).expand(n, vocab).contiguous()
    allowed = torch.zeros(n, vocab, dtype=torch.bool)
    allowed[:, [0, 5, 33, 39]] = True  # 33 and 39 in the second mask word
    greedy = torch.zeros(n, dtype=torch.bool)
    picked = sample_race(logits.to(DEV), greedy.to(DEV), None, seed=7, bitmask=_bitmask(allowed)).cpu()
    assert set(picked.tolist()) <= {0, 5, 33, 39}
    p = torch.softmax(logits[0, [0, 5, 33, 39]], dim=0)
    observed = [int((picked == t).sum()) for t in (0, 5, 33, 39)]
    assert chi_square_p(observed, (p * n).tolist()) > ALPHA


def test_the_seed_fixes_the_draws_and_rows_draw_apart():
    logits = torch.zeros(64, 500, device=DEV)  # uniform: every row's draw is its noise alone
    greedy = torch.zeros(64, dtype=torch.bool, device=DEV)
    first = sample_race(logits, greedy, None, seed=99)
    assert torch.equal(first, sample_race(logits, greedy, None, seed=99))
    assert not torch.equal(first, sample_race(logits, greedy, None, seed=100))
    assert len(set(first.tolist())) > 40  # identical rows get their own noise


def test_head_dtype_logits_draw_as_their_float32_widening():
    """The one-pass sampler reads a bf16 model's logits as the head wrote them (`head_logits`): the same
    seed draws the same tokens as from their float32 copy, greedy rows and ragged blocks included."""
    g = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(8, 3000, generator=g)).to(torch.bfloat16).to(DEV)
    greedy = torch.tensor([True, False] * 4, device=DEV)
    temperature = torch.full((8,), 0.7, device=DEV)
    for seed in (1, 2, 3):
        assert torch.equal(
            sample_race(logits, greedy, temperature, seed), sample_race(logits.float(), greedy, temperature, seed)
        )
