"""verify(): first-token exactness (chi-square vs p), acceptance rate, power checks, edge cases."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from broken_verifiers import accept_if_p_ge_q_verify, naive_resample_verify

from trtspec.analysis.gof import chi_square_gof
from trtspec.spec.sample.probs import SamplingParams, logits_to_probs
from trtspec.spec.sample.verify import verify

ALPHA = 1e-3
TRIALS = 20_000
V = 10


def _probs(seed: int, **params) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return logits_to_probs(torch.randn(V, generator=g) * 1.5, SamplingParams(**params))


def _pair(seed: int, noise: float = 1.0, **params) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q) as a draft relates to its target: draft logits = target logits + noise, both
    shaped by the same SamplingParams (the exactness rule)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, generator=g) * 1.5
    draft_logits = logits + noise * torch.randn(V, generator=g)
    sp = SamplingParams(**params)
    return logits_to_probs(logits, sp), logits_to_probs(draft_logits, sp)


def _disjoint() -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.zeros(V)
    p[:4] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    q = torch.zeros(V)
    q[4:] = 1 / (V - 4)
    return p, q


# name → (p, q); q None = point-mass drafts, the proposed token drawn uniformly
CASES: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {
    "unrelated": (_probs(1), _probs(2)),
    "draft_like": _pair(3),
    "q_zero_where_p_positive": (_probs(4), _probs(5, top_k=3)),
    "p_zero_where_q_positive": (_probs(6, top_k=4), _probs(7)),
    "p_equals_q": (_probs(8), _probs(8)),
    "top_k_both": _pair(9, top_k=5),
    "top_p_both": _pair(10, top_p=0.9),
    "temperature_0.7": _pair(11, temperature=0.7),
    "t1.5_topk6_topp0.9": _pair(12, temperature=1.5, top_k=6, top_p=0.9),
    "disjoint_supports": _disjoint(),
    "point_mass": (_probs(13), None),
}


def run_first_token(verify_fn: Callable, p: torch.Tensor, q: torch.Tensor | None, seed: int,
                    k: int = 1, ragged: bool = False):
    """TRIALS independent rounds in one batch; returns (first tokens, accepted at position 0, rows
    that proposed at position 0, expected acceptance)."""
    g = torch.Generator().manual_seed(seed)
    bonus = _probs(seed + 100)  # p at later positions: must never leak into the first token
    target = torch.stack([p] + [bonus] * k).expand(TRIALS, k + 1, V)  # [N, K+1, V]
    proposal = q if q is not None else torch.full((V,), 1 / V)  # point mass drawn from uniform
    draft_ids = torch.multinomial(proposal.expand(TRIALS, V), k, replacement=True, generator=g)
    draft_probs = None if q is None else q.expand(TRIALS, k, V)
    num_draft = (torch.randint(0, k + 1, (TRIALS,), generator=g) if ragged
                 else torch.full((TRIALS,), k))
    out = verify_fn(target, draft_ids, draft_probs, num_draft, generator=g)
    proposed = num_draft >= 1
    expected = float(torch.minimum(p, q).sum()) if q is not None else float((p * proposal).sum())
    return out.token_ids[:, 0], out.num_accepted[proposed] >= 1, proposed, expected


def chi_square_p(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).tolist()
    return chi_square_gof(counts, p.tolist())[2]


@pytest.mark.parametrize("name", list(CASES))
def test_first_token_is_distributed_as_p(name: str) -> None:
    p, q = CASES[name]
    first, accepted, _, expected = run_first_token(verify, p, q, seed=list(CASES).index(name))
    assert bool((first >= 0).all())
    pval = chi_square_p(first, p)
    assert pval > ALPHA, f"{name}: chi-square p-value {pval:.2e}"
    measured = float(accepted.float().mean())
    sigma = math.sqrt(expected * (1 - expected) / len(accepted))
    if sigma == 0:
        assert measured == pytest.approx(expected, abs=1e-12)
    else:
        assert abs(measured - expected) <= 4 * sigma, (name, measured, expected, sigma)


def test_first_token_exact_with_ragged_drafts_in_one_batch() -> None:
    p, q = CASES["draft_like"]
    first, accepted, proposed, expected = run_first_token(verify, p, q, seed=3, k=3, ragged=True)
    assert 0.2 < float(proposed.float().mean()) < 0.9  # a real mix of 0..3 drafts
    assert chi_square_p(first, p) > ALPHA
    sigma = math.sqrt(expected * (1 - expected) / len(accepted))
    assert abs(float(accepted.float().mean()) - expected) <= 4 * sigma


SEED_P = torch.tensor([0.5, 0.5])
SEED_Q = torch.tensor([0.8, 0.2])


def _two_token_trials(verify_fn: Callable, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    target = SEED_P.expand(TRIALS, 2, 2)
    draft_ids = torch.multinomial(SEED_Q.expand(TRIALS, 2), 1, generator=g)
    out = verify_fn(target, draft_ids, SEED_Q.expand(TRIALS, 1, 2), torch.ones(TRIALS), g)
    return out.token_ids[:, 0]


def test_seed_two_token_example_exact() -> None:
    first = _two_token_trials(verify)
    p_a = float((first == 0).float().mean())
    assert p_a == pytest.approx(0.5, abs=4 * math.sqrt(0.25 / TRIALS))
    assert chi_square_gof(torch.bincount(first, minlength=2).tolist(), SEED_P.tolist())[2] > ALPHA


@pytest.mark.parametrize(("broken", "expected_p_a"), [(naive_resample_verify, 0.65),
                                                      (accept_if_p_ge_q_verify, 0.0)])
def test_power_broken_verifiers_fail_the_seed_example(broken: Callable, expected_p_a: float
                                                      ) -> None:
    first = _two_token_trials(broken)
    assert float((first == 0).float().mean()) == pytest.approx(expected_p_a, abs=0.015)
    pval = chi_square_gof(torch.bincount(first, minlength=2).tolist(), SEED_P.tolist())[2]
    assert pval < ALPHA, "the chi-square test must reject a broken verifier"


@pytest.mark.parametrize("broken", [naive_resample_verify, accept_if_p_ge_q_verify])
@pytest.mark.parametrize("name", ["draft_like", "top_p_both", "t1.5_topk6_topp0.9"])
def test_power_broken_verifiers_fail_the_random_cases(broken: Callable, name: str) -> None:
    p, q = CASES[name]
    first, *_ = run_first_token(broken, p, q, seed=11)
    assert chi_square_p(first, p) < ALPHA


def test_residual_without_mass_samples_from_p_never_nan() -> None:
    """p ≤ q everywhere (here p = q/2, unnormalised) makes max(0, p − q) all zero."""
    q = _probs(20)
    p = q / 2
    n = 4000
    g = torch.Generator().manual_seed(0)
    ids = torch.multinomial(q.expand(n, V), 1, generator=g)
    out = verify(p.expand(n, 2, V), ids, q.expand(n, 1, V), torch.ones(n), g)
    assert bool((out.num_accepted == 0).any()), "some rows must have been rejected"
    first = out.token_ids[:, 0]
    assert bool((first >= 0).all()) and bool((first < V).all())
    assert chi_square_p(first, q) > ALPHA  # p normalised is q


def test_point_mass_rejection_never_re_emits_the_rejected_token() -> None:
    p = torch.tensor([0.0, 0.7, 0.3] + [0.0] * (V - 3))
    n = 2000
    ids = torch.full((n, 1), 1)
    out = verify(p.expand(n, 2, V), ids, None, torch.ones(n), torch.Generator().manual_seed(1))
    rejected = out.num_accepted == 0
    assert 0.2 < float(rejected.float().mean()) < 0.4
    assert bool((out.token_ids[rejected, 0] == 2).all())  # residual of p with token 1 removed


def test_greedy_is_token_matching_and_mixed_batches_work() -> None:
    target = torch.zeros(3, 4, V)
    target[:, 0, 2] = target[:, 1, 5] = target[:, 2, 7] = target[:, 3, 1] = 1.0
    target[2] = torch.full((4, V), 1 / V)  # a sampled row: uniform p accepts any draft w.p. ≥ 1/V
    drafts = torch.tensor([[2, 5, 7], [2, 4, 7], [3, 3, 3]])
    greedy = torch.tensor([True, True, False])
    out = verify(target, drafts, None, torch.tensor([3, 3, 2]), torch.Generator().manual_seed(0),
                 greedy)
    assert out.token_ids[0].tolist() == [2, 5, 7, 1] and bool(out.bonus[0])
    assert out.token_ids[1].tolist() == [2, 5, -1, -1] and int(out.num_emitted[1]) == 2
    assert int(out.num_emitted[2]) == int(out.num_accepted[2]) + 1
    all_greedy = verify(target[:2], drafts[:2], None, torch.tensor([3, 3]), greedy=True)
    assert torch.equal(all_greedy.token_ids, out.token_ids[:2])


def test_request_output_does_not_depend_on_batch_neighbours() -> None:
    """Per-row generators: row 0 alone (K = 2) equals row 0 inside a batch padded to K = 5."""
    p, q = _probs(30), _probs(31)
    alone_gen, batch_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    ids = torch.tensor([[3, 1]])
    alone = [verify(p.expand(1, 3, V), ids, q.expand(1, 2, V), torch.tensor([2]),
                    [alone_gen]) for _ in range(50)]
    others = [torch.Generator().manual_seed(100 + i) for i in range(7)]
    big_ids = torch.randint(0, V, (8, 5))
    big_ids[0, :2] = ids[0]
    batched = [verify(p.expand(8, 6, V), big_ids, q.expand(8, 5, V),
                      torch.tensor([2, 5, 0, 3, 5, 1, 4, 2]), [batch_gen, *others])
               for _ in range(50)]
    for a, b in zip(alone, batched, strict=True):
        assert a.token_ids[0, :3].tolist() == b.token_ids[0, :3].tolist()
        assert int(a.num_accepted[0]) == int(b.num_accepted[0])


def test_zero_drafts_samples_from_p_and_shapes_are_checked() -> None:
    out = verify(_probs(40).expand(5, 1, V), torch.empty(5, 0, dtype=torch.long), None,
                 torch.zeros(5))
    assert out.token_ids.shape == (5, 1) and bool(out.bonus.all())
    with pytest.raises(ValueError, match=r"draft_token_ids must be \[B, K\]"):
        verify(torch.rand(2, 3, V), torch.zeros(2, 3, dtype=torch.long), None, torch.ones(2))
    with pytest.raises(ValueError, match=r"draft_probs must be \[B, K, V\]"):
        verify(torch.rand(2, 3, V), torch.zeros(2, 2, dtype=torch.long), torch.rand(2, 2, 3),
               torch.ones(2))
    with pytest.raises(ValueError, match="num_draft must be"):
        verify(torch.rand(2, 3, V), torch.zeros(2, 2, dtype=torch.long), None, torch.tensor([1, 3]))
