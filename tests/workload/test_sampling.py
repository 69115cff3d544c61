"""The sort-free nucleus sampler against the sort-based rule (workload/rollout/sampling.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pytest_rlkernel_matrix.workload.rollout import sampling  # noqa: E402


def _rows(seed: int, b: int, v: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(b, v, generator=g) * scale, -1)


def test_same_nucleus_and_frequencies_as_the_sorted_rule() -> None:
    n, v = 100_000, 40
    lp = _rows(0, 1, v).expand(n, v).contiguous()
    u = torch.rand(n, generator=torch.Generator().manual_seed(1))
    new = torch.bincount(sampling.sample_top_p(lp, 0.9, u), minlength=v).double() / n
    old = torch.bincount(sampling._sorted_top_p(lp.exp(), 0.9, u), minlength=v).double() / n
    assert torch.equal(new > 0, old > 0)  # the same nucleus
    assert 1 < int((new > 0).sum()) < v
    assert float((new - old).abs().max()) < 0.01  # the same distribution (n = 1e5: sd < 0.002)


def test_a_rows_token_does_not_depend_on_its_batch() -> None:
    lp, u = _rows(2, 48, 3000, 1.0), torch.rand(48, generator=torch.Generator().manual_seed(3))
    whole = sampling.sample_top_p(lp, 0.95, u)
    alone = torch.cat([sampling.sample_top_p(lp[i:i + 1], 0.95, u[i:i + 1]) for i in range(48)])
    assert torch.equal(whole, alone)
    assert torch.equal(whole, sampling.sample_top_p(lp, 0.95, u))  # deterministic


def test_fixed_point_is_the_float64_floor() -> None:
    p = torch.cat([_rows(6, 64, 5000, 4.0).exp().flatten(), torch.tensor([0.0, 1.0, 2.0**-41])])
    assert torch.equal(sampling._fixed(p), (p.double() * 2.0**40).floor().to(torch.int64))
    assert torch.equal(sampling._fixed(p.to(torch.bfloat16)),
                       (p.to(torch.bfloat16).double() * 2.0**40).floor().to(torch.int64))


def test_top_p_one_and_the_round_limit() -> None:
    lp = _rows(4, 8, 100)
    u = torch.full((8,), 0.999999)
    tok = sampling.sample_top_p(lp, 1.0, u)
    assert torch.all((tok >= 0) & (tok < 100))
    # a nucleus of one token: every draw but the most probable is rejected, then the argmax
    peaked = torch.log_softmax(torch.tensor([[0.0, 8.0, 1.0, 0.5]]).expand(4, 4), -1)
    assert sampling.sample_top_p(peaked, 0.5, torch.tensor([0.0, 0.3, 0.7, 0.99])).tolist() \
        == [1, 1, 1, 1]


def _one_level(q: torch.Tensor, pivot: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The draw as one cumulative sum over the whole vocabulary (the earlier definition)."""
    cdf = torch.where(q > pivot[:, None], q, 0).cumsum(-1)
    total = cdf[:, -1]
    x = torch.minimum((u.double() * total.double()).floor().to(torch.int64), total - 1)
    return torch.searchsorted(cdf, x[:, None].contiguous(), right=True)[:, 0]


@pytest.mark.parametrize("v", [sampling.BLOCK * 9, 1000])  # a vocabulary padded to BLOCK too
def test_two_level_draw_is_the_one_level_cumsum_draw(v: int) -> None:
    """Block masses then the token inside the block: the index one cumsum over the vocabulary
    gives, for every pivot (rejection round) and uniforms at both ends, zeros in between."""
    lp = _rows(10, 64, v, 3.0)
    lp[:, 5:40] = float("-inf")  # zero-probability runs: never drawn
    probs = lp.exp()
    padded = torch.nn.functional.pad(probs, (0, -v % sampling.BLOCK))
    q = sampling._fixed(probs)
    u = torch.cat([torch.rand(60, generator=torch.Generator().manual_seed(11)),
                   torch.tensor([0.0, 1e-12, 0.999999, 1.0 - 2.0**-24])])
    for pivot in (torch.full((64,), -1), q.median(-1).values, q.max(-1).values - 1):
        got = sampling._draw(padded, pivot, u)
        assert torch.equal(got, _one_level(q, pivot, u))
        assert torch.all(q.gather(-1, got[:, None])[:, 0] > pivot)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_batch_invariant_on_cuda_at_full_vocabulary() -> None:
    """Qwen3's vocabulary, rows decoded 64 together, 3 together and alone: the same tokens.
    (Float sums over the vocabulary are not batch-invariant on CUDA: how many of the rows'
    nucleus masses differ in their bits between the batch and the row alone is printed.)"""
    b, v = 64, 151_936
    g = torch.Generator(device="cuda").manual_seed(5)
    lp = torch.log_softmax(torch.randn(b, v, device="cuda", generator=g) * 3.0, -1)
    u = torch.rand(b, device="cuda", generator=g)
    whole = sampling.sample_top_p(lp, 0.95, u)
    threes = torch.cat([sampling.sample_top_p(lp[i:i + 3], 0.95, u[i:i + 3])
                        for i in range(0, b, 3)])
    alone = torch.cat([sampling.sample_top_p(lp[i:i + 1], 0.95, u[i:i + 1]) for i in range(b)])
    assert torch.equal(whole, alone) and torch.equal(whole, threes)
    p = lp.exp()
    batch_sum = p.sum(-1)
    row_sums = torch.cat([p[i:i + 1].sum(-1) for i in range(b)])
    print(f"float32 row sums differing batch vs alone: {int((batch_sum != row_sums).sum())}/{b}")


def test_processed_logprob_renormalizes_over_the_samplers_nucleus() -> None:
    """``sampling=processed`` (factors.py): the logprob over the nucleus the sampler accepts
    from, a row's value independent of its batch, ties at the edge kept together."""
    from pytest_rlkernel_matrix.workload.factors import processed_selected

    lp, u = _rows(8, 32, 3000, 1.0), torch.rand(32, generator=torch.Generator().manual_seed(9))
    tok = sampling.sample_top_p(lp, 0.9, u)
    got = processed_selected(lp, tok, 0.9)
    alone = torch.cat([processed_selected(lp[i:i + 1], tok[i:i + 1], 0.9) for i in range(32)])
    assert torch.equal(got, alone)
    p = lp.double().exp()  # the sorted rule in float64: close to the fixed-point sums
    sp = p.sort(-1, descending=True).values
    z = (sp * ((sp.cumsum(-1) - sp) < 0.9)).sum(-1)
    want = lp.gather(-1, tok[:, None])[:, 0].double() - z.log()
    assert float((got.double() - want).abs().max()) < 1e-6
    assert torch.all(got > lp.gather(-1, tok[:, None])[:, 0]) and torch.all(got <= 0)
    # a 0.3 / 0.3 tie at the edge of top_p = 0.5 (0.4 above both): both kept, so Z = 1 and
    # the processed probability of a tied token is its raw 0.3 (a float cumsum cut gives 0.3/0.7)
    tied = torch.tensor([[0.4, 0.3, 0.3]]).log()
    assert abs(float(processed_selected(tied, torch.tensor([2]), 0.5).exp()) - 0.3) < 1e-6
    assert abs(float(processed_selected(tied, torch.tensor([0]), 1.0).exp()) - 0.4) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_compiled_passes_give_the_eager_tokens_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Inductor passes (block sums, mass above a token) are exact integer sums of exact
    casts: on Qwen3's vocabulary the compiled sampler draws the eager sampler's tokens."""
    b, v = 448, 151_936
    g = torch.Generator(device="cuda").manual_seed(12)
    lp = torch.log_softmax(torch.randn(b, v, device="cuda", generator=g) * 3.0, -1)
    u = torch.rand(b, device="cuda", generator=g)
    monkeypatch.setattr(sampling, "COMPILE", False)
    eager = sampling.sample_top_p(lp, 0.95, u)
    monkeypatch.setattr(sampling, "COMPILE", True)
    fused = sampling.sample_top_p(lp, 0.95, u)
    fused_small = sampling.sample_top_p(lp[:37], 0.95, u[:37])  # another batch: dynamic shape
    assert torch.equal(eager, fused) and torch.equal(eager[:37], fused_small)
    assert sampling.sampler_mode().startswith("_block_sums: inductor; _mass_above: inductor")


@pytest.mark.parametrize("spare", [0, 3, 64], ids=["round0", "round1-overflow", "round1"])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 1.0])
def test_graph_rounds_in_a_bucket_then_finish_is_sample_top_p(top_p: float, spare: int) -> None:
    """A decode graph takes round 0 over its whole batch bucket (rows it no longer samples
    included) and round 1 over the first ``spare`` rows round 0 rejected; the live rows' tokens
    after ``finish`` are ``sample_top_p``'s on those rows alone: with every rejected row in
    round 1 (finish goes on from round 2 where a row is rejected twice), with more rejected rows
    than round 1 takes (finish starts again from round 1), and with round 0 alone."""
    lp = _rows(11, 40, 1000, 6.0)
    u = torch.rand(40, generator=torch.Generator().manual_seed(12))
    live = torch.tensor([0, 3, 4, 9, 17, 18, 30, 39])
    whole = sampling.first_round(lp, top_p, u, spare)
    drawn = whole.rows(live)
    assert drawn.probs.shape[0] == 40  # kept whole: the live rows map into it
    want = sampling.sample_top_p(lp[live], top_p, u[live])
    assert torch.equal(sampling.finish(drawn, top_p, u[live]), want)
    assert torch.equal(sampling.finish(whole, top_p, u), sampling.sample_top_p(lp, top_p, u))
    if top_p < 1.0:
        assert not bool(whole.ok.all())  # round 0 rejected rows
    if top_p == 0.3 and spare:
        assert whole.overflow is not None and whole.done1 is not None
        assert bool(whole.overflow) == (spare == 3)
        assert not bool(whole.done1.all())  # rows rejected twice: the rounds after ran
