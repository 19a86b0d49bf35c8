"""Top-p sampling without a sort (megatron_hybrid.inference.topp_kernel): the reference and the Triton kernel.

The PyTorch reference, which every run without Triton takes, is checked against an independent brute force (the
definition, token by token, in float64), against sampling.sample()'s sort-based top-p where the two rules agree
(no ties), and statistically against the renormalised nucleus. The Triton kernel is checked against the reference:
the same tokens.

Rows whose boundary mass lies within rounding of ``top_p`` (the rules and the summation orders may then disagree by
design) are left out of the comparisons; each test asserts that it keeps most rows. Two kinds of race draws:
Exp(1) draws, as in sampling, and probe draws ``E_i = p_i * w_i`` with ``w`` increasing in the token's probability
rank, under which the least probable kept token wins: the token then shows where the nucleus ends.

The Triton tests (named ``test_triton_*``) run where Triton is importable: on a GPU in this process, otherwise in
Triton's CPU interpreter, which must be switched on before the kernel is defined, so :func:`test_interpreter_subprocess`
runs them in a child pytest with ``TRITON_INTERPRET=1``. Without Triton they are skipped.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hybrid.inference import sampling, topp_kernel
from tests.triton_support import CUDA, INTERPRET, TRITON_DEVICE, needs_triton, run_interpreted


TINY = torch.finfo(torch.float32).tiny
# Rows whose boundary mass lies closer than this to top_p are left out. The two paths' fp32 masses differ by well
# under 1e-6: the kernel adds ~V / 1024 terms per lane before a tree (at most 31 * 2**-24 = 1.9e-6 relative at
# V = 32000, ~2e-7 for random signs), the reference's cumsum and sum are good to a few ulps, and the GPU's exp is off
# by ~2**-22 relative where the mass is (x near the maximum).
BOUNDARY_GAP = 2e-6


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------
# Independent computations (float64) and race draws


def scaled(logits_nV: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """The fp32 x both paths sample from: the logits times 1 / temperature rounded to fp32."""
    inv = (torch.tensor(1.0) / torch.tensor(temperature, dtype=torch.float32)).item()
    return logits_nV[:, :vocab_size].float() * inv


def mass_above(x_nV: torch.Tensor) -> torch.Tensor:
    """float64 ``[n, V]``: per token, the probability of the tokens with a strictly larger x (all pairs)."""
    p = torch.softmax(x_nV.double(), dim=-1)
    larger = x_nV[:, None, :] > x_nV[:, :, None]  # [n, i, j]: x_j > x_i
    return (p[:, None, :] * larger).sum(dim=-1)


def boundary_gap(x_nV: torch.Tensor, top_p: float) -> torch.Tensor:
    """float64 ``[n]``: how close the mass above a row's tokens comes to ``top_p`` (one sort per row, for
    vocabularies too large for :func:`mass_above`). Without ties these are also the sorted rule's prefix masses."""
    p = torch.softmax(x_nV.double(), dim=-1)
    x_sorted, order = x_nV.sort(dim=-1, descending=True)
    p_sorted = p.gather(-1, order)
    before = p_sorted.cumsum(dim=-1) - p_sorted
    # The mass above a token is the prefix mass before the first of its tied group.
    first_of_group = torch.searchsorted(-x_sorted, -x_nV, right=False)
    return (before.gather(-1, first_of_group) - top_p).abs().amin(dim=-1)


def brute_race(x_nV: torch.Tensor, kept_nV: torch.Tensor, noise_nV: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(x_nV.double(), dim=-1)
    return torch.where(kept_nV, p / noise_nV.double().clamp(min=TINY), -1.0).argmax(dim=-1)


def exp_noise(n: int, V: int, g: torch.Generator) -> torch.Tensor:
    return torch.empty(n, V).exponential_(generator=g)


def probe_noise(x_nV: torch.Tensor) -> torch.Tensor:
    """Draws under which p_i / E_i = 1 / w_i (up to rounding), w_i = 1 + 4 * rank_i / V with rank 0 the least
    probable token (ties by column): the least probable kept token wins. Rounding moves p_i / E_i by ~1e-6
    relative, far less than the 4 / V between neighbours."""
    V = x_nV.shape[1]
    e = torch.exp(x_nV - x_nV.amax(dim=-1, keepdim=True))
    rank = torch.empty_like(x_nV)
    order = x_nV.sort(dim=-1, stable=True).indices
    rank.scatter_(-1, order, torch.arange(V, dtype=torch.float32).expand_as(x_nV).contiguous())
    return (e * (1 + 4 * rank / V)).clamp(min=TINY)


def race_args(temperature: float, top_p: float, vocab_size: int) -> dict:
    return dict(vocab_size=vocab_size, temperature=temperature, top_p=top_p)


# ---------------------------------------------------------------------------------------------------------------
# The reference against independent computations


def tie_rich_logits(n_per_kind: int, V: int, g: torch.Generator) -> torch.Tensor:
    """Rows of three kinds: continuous, rounded to halves (~10 values, many tied), five repeated values."""
    continuous = 2 * torch.randn(n_per_kind, V, generator=g)
    halves = (2 * torch.randn(n_per_kind, V, generator=g)).round() / 2
    values = torch.randn(n_per_kind, 5, generator=g)
    repeated = values.gather(-1, torch.randint(0, 5, (n_per_kind, V), generator=g))
    return torch.cat([continuous, halves, repeated])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_p", [0.25, 0.8, 0.99])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_matches_brute_force(dtype: torch.dtype, top_p: float, temperature: float) -> None:
    V = 40
    g = _generator(0)
    logits = tie_rich_logits(32, V, g).to(dtype)
    n = logits.shape[0]
    padded = torch.full((n, V + 3), float("nan"), dtype=dtype)  # padding columns never read
    padded[:, :V] = logits
    x = scaled(padded, V, temperature)
    above = mass_above(x)
    kept = above <= top_p
    clear = (above - top_p).abs().amin(dim=-1) > BOUNDARY_GAP
    assert clear.sum() >= 0.9 * n
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    assert torch.equal(topp_kernel._nucleus(x, e, top_p)[clear], kept[clear])
    # Ties straddle the boundary in some rows: more tokens kept than the sorted rule's shortest prefix.
    p_sorted = torch.softmax(x.double(), dim=-1).sort(dim=-1, descending=True).values
    prefix = ((p_sorted.cumsum(dim=-1) - p_sorted) <= top_p).sum(dim=-1)
    assert (kept.sum(dim=-1) > prefix)[clear].any()
    for noise in (exp_noise(n, V, g), probe_noise(x)):
        tokens = topp_kernel._top_p_race_reference(padded, noise, **race_args(temperature, top_p, V))
        assert torch.equal(tokens[clear], brute_race(x, kept, noise)[clear])


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_agrees_with_sample_without_ties(top_p: float, temperature: float) -> None:
    from megatron.core.inference.sampling_params import SamplingParams

    n, V = 48, 1000
    g = _generator(1)
    logits = 3 * torch.randn(n, V + 24, generator=g)
    # sample() divides by the temperature where the reference multiplies by its reciprocal (equal on a GPU, one ulp
    # apart on the CPU): rows clear of the boundary and of ties agree either way.
    x = scaled(logits, V, temperature)
    assert all(len(row.unique()) == V for row in x), "continuous logits: no ties"
    clear = boundary_gap(x, top_p) > BOUNDARY_GAP
    assert clear.sum() >= 0.9 * n
    params = SamplingParams(temperature=temperature, top_k=0, top_p=top_p)
    for noise in (exp_noise(n, V, g), probe_noise(x)):
        expected, _ = sampling.sample(logits, params, vocab_size=V, noise_nV=noise)
        tokens = topp_kernel._top_p_race_reference(logits, noise, **race_args(temperature, top_p, V))
        assert torch.equal(tokens[clear], expected[clear])


@pytest.mark.parametrize("logits,top_p,temperature,kept", [
    # A tie at the boundary: mass above the two 1.5s is 0.694 <= 0.75, so both are kept (the sorted rule keeps one).
    ([3.0, 2.0, 1.5, 1.5, 0.5, 0.0, -1.0, -2.0], 0.75, 1.0, 4),
    ([1.2, -0.3, 2.2, 0.1, 0.9, -1.5, 1.7, 0.4], 0.9, 0.7, 4),  # masses above: 0.846 kept, next 0.922
])
def test_reference_draws_follow_the_nucleus(logits: list[float], top_p: float, temperature: float,
                                            kept: int) -> None:
    N, V = 200_000, len(logits)
    x = scaled(torch.tensor([logits]), V, temperature)
    nucleus = mass_above(x)[0] <= top_p
    assert nucleus.sum() == kept
    p = torch.softmax(x[0].double(), dim=-1) * nucleus
    q = p / p.sum()
    noise = exp_noise(N, V, _generator(2))
    tokens = topp_kernel._top_p_race_reference(torch.tensor([logits]).expand(N, V), noise,
                                               **race_args(temperature, top_p, V))
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[~nucleus].sum() == 0
    # Chi-square over the kept tokens, kept - 1 degrees of freedom; its p-value Q(df / 2, chi2 / 2) fails one
    # correct sampler in 10**4. Total variation: ~1.4e-3 expected at this N (a sampler that drops one 0.11 token
    # is at 0.1).
    expected = N * q[nucleus]
    chi2 = ((counts[nucleus] - expected) ** 2 / expected).sum()
    p_value = torch.special.gammaincc(torch.tensor((kept - 1) / 2, dtype=torch.float64), chi2 / 2)
    assert p_value > 1e-4, (chi2, counts, expected)
    assert 0.5 * (counts / N - q).abs().sum() < 5e-3


def test_bad_arguments_raise() -> None:
    logits, noise = torch.zeros(2, 8), torch.ones(2, 6)
    ok = dict(vocab_size=6, temperature=1.0, top_p=0.9)
    for bad, match in [(dict(temperature=0.0), "temperature=0.0"), (dict(temperature=-1.0), "temperature=-1.0"),
                       (dict(temperature=float("inf")), "temperature=inf"), (dict(top_p=0.0), "top_p=0.0"),
                       (dict(top_p=1.0), "top_p=1.0"), (dict(vocab_size=9), "vocab_size=9"),
                       (dict(vocab_size=0), "vocab_size=0")]:
        with pytest.raises(ValueError, match=match):
            topp_kernel.top_p_race(logits, noise, **{**ok, **bad})
    with pytest.raises(ValueError, match=r"noise_nV must be \(2, 6\) float32"):
        topp_kernel.top_p_race(logits, torch.ones(2, 8), **ok)
    with pytest.raises(ValueError, match=r"noise_nV must be \(2, 6\) float32"):
        topp_kernel.top_p_race(logits, noise.double(), **ok)
    with pytest.raises(ValueError, match="logits_nV must be 2-D"):
        topp_kernel.top_p_race(logits.long(), noise, **ok)
    with pytest.raises(ValueError, match=r"out is \(2,\) torch.int32"):
        topp_kernel.top_p_race(logits, noise, out=torch.empty(2, dtype=torch.int32), **ok)


def test_cpu_tensors_take_the_reference_outside_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not topp_kernel.use_triton(torch.empty(1))
    g = _generator(3)
    logits, noise = torch.randn(4, 50, generator=g), exp_noise(4, 40, g)
    out = torch.empty(4, dtype=torch.int64)
    result = topp_kernel.top_p_race(logits, noise, out=out, **race_args(0.8, 0.9, 40))
    assert result is out
    assert torch.equal(out, topp_kernel._top_p_race_reference(logits, noise, **race_args(0.8, 0.9, 40)))


# ---------------------------------------------------------------------------------------------------------------
# The Triton kernel against the reference


def kernel_case(*, V: int, V_padded: int, dtype: torch.dtype, temperature: float, layout: str,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Five rows, each its own test: peaked with Exp(1) draws; peaked, nearly uniform and tied (values in halves)
    with probe draws; and two equal maxima with equal draws (the race ties: the lower column must win). The
    logits as a view with padding columns of NaN (``layout`` "rows": a column slice of a wider buffer; "columns":
    every other column of one), the draws as a column slice. Returns the logits, the draws and the tied row's
    lower column."""
    g = _generator(seed)
    rows = torch.stack([4 * torch.randn(V, generator=g), 4 * torch.randn(V, generator=g),
                        0.01 * torch.randn(V, generator=g), (2 * torch.randn(V, generator=g)).round() / 2,
                        2 * torch.randn(V, generator=g)])
    # In different steps of the vocabulary loop, the last column in the short last step; 768 apart at V = 1000, so in
    # one lane for steps of 256 (later steps of a lane must not replace an equal value).
    first, last = (V - 1) % 256, V - 1
    rows[4, [first, last]] = rows[4].max() + 1
    width = {"rows": V_padded + 3, "columns": 2 * V_padded}[layout]
    buffer = torch.full((5, width), float("nan"), dtype=dtype)
    logits = buffer[:, 3:] if layout == "rows" else buffer[:, ::2]
    logits[:, :V] = rows.to(dtype)
    x = scaled(logits, V, temperature)
    noise = torch.full((5, V + 5), float("nan"))[:, 5:]
    noise[[0, 4]] = exp_noise(2, V, g)
    noise[1:4] = probe_noise(x[1:4])
    noise[4, [first, last]] = 1e-8  # far above every other race value of the row
    return logits.to(TRITON_DEVICE), noise.to(TRITON_DEVICE), first


def check_kernel(*, V: int, V_padded: int, dtype: torch.dtype, top_p: float, temperature: float,
                 layout: str = "rows", seed: int = 0) -> None:
    logits, noise, tie_column = kernel_case(V=V, V_padded=V_padded, dtype=dtype, temperature=temperature,
                                            layout=layout, seed=seed)
    args = race_args(temperature, top_p, V)
    expected = topp_kernel._top_p_race_reference(logits, noise, **args)
    out = torch.full((5,), -1, dtype=torch.int64, device=TRITON_DEVICE)
    assert topp_kernel.top_p_race(logits, noise, out=out, **args) is out
    clear = boundary_gap(scaled(logits, V, temperature).cpu(), top_p) > BOUNDARY_GAP
    assert clear[1:4].all(), "the probe rows must be clear of the boundary (choose another seed)"
    assert torch.equal(out.cpu()[clear], expected.cpu()[clear])
    assert out[4] == expected[4] == tie_column


@needs_triton
@pytest.mark.usefixtures("triton_interpreter_fixes")
@pytest.mark.parametrize("dtype,top_p,temperature,layout", [
    (torch.float32, 0.1, 1.0, "rows"),
    (torch.float32, 0.9, 0.7, "columns"),
    (torch.float32, 0.999, 0.7, "rows"),
    (torch.bfloat16, 0.1, 0.7, "columns"),
    (torch.bfloat16, 0.9, 1.0, "rows"),
    (torch.bfloat16, 0.999, 0.7, "rows"),
])
def test_triton_top_p_race_matches_reference(dtype: torch.dtype, top_p: float, temperature: float,
                                             layout: str) -> None:
    check_kernel(V=1000, V_padded=1024, dtype=dtype, top_p=top_p, temperature=temperature, layout=layout)


@needs_triton
@pytest.mark.usefixtures("triton_interpreter_fixes")
@pytest.mark.parametrize("max_rounds", [0, 1])
def test_triton_top_p_race_threshold_search_fallback(monkeypatch, max_rounds: int) -> None:
    # After _MAX_ROUNDS rejections the kernel searches for the threshold instead: forced here from the start (0) and
    # after one round (1), on rows whose winners are mostly outside the nucleus at top_p 0.1.
    monkeypatch.setattr(topp_kernel, "_MAX_ROUNDS", max_rounds)
    check_kernel(V=1000, V_padded=1024, dtype=torch.float32, top_p=0.1, temperature=1.0, seed=3)
    check_kernel(V=1000, V_padded=1024, dtype=torch.bfloat16, top_p=0.9, temperature=0.7, seed=4)


@needs_triton
@pytest.mark.usefixtures("triton_interpreter_fixes")
def test_triton_top_p_race_many_steps(monkeypatch) -> None:
    # Steps of 256 columns: four steps of every pass over V = 1000, the last one short.
    monkeypatch.setattr(topp_kernel, "_BLOCK", 256)
    check_kernel(V=1000, V_padded=1024, dtype=torch.bfloat16, top_p=0.9, temperature=0.7, seed=1)


@needs_triton
@pytest.mark.usefixtures("triton_interpreter_fixes")
@pytest.mark.parametrize("dtype,top_p,temperature", [(torch.float32, 0.9, 0.7), (torch.bfloat16, 0.1, 1.0),
                                                     (torch.bfloat16, 0.999, 0.7)])
def test_triton_top_p_race_large_vocabulary(monkeypatch, dtype: torch.dtype, top_p: float,
                                            temperature: float) -> None:
    if INTERPRET:  # the interpreter's cost is per step: fewer, larger steps (the GPU runs the module's sizes)
        monkeypatch.setattr(topp_kernel, "_BLOCK", 16384)
    check_kernel(V=32000, V_padded=32064, dtype=dtype, top_p=top_p, temperature=temperature, seed=2)


@needs_triton
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_triton_top_p_race_replays_in_a_cuda_graph() -> None:
    n, V, V_padded = 32, 32000, 32064
    g = _generator(4)
    logits = torch.empty(n, V_padded, dtype=torch.bfloat16, device="cuda")
    noise = torch.empty(n, V, device="cuda")
    out = torch.empty(n, dtype=torch.int64, device="cuda")
    args = race_args(0.8, 0.9, V)

    def fill() -> None:
        logits.copy_(3 * torch.randn(n, V_padded, generator=g))
        noise.copy_(exp_noise(n, V, g))

    fill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        topp_kernel.top_p_race(logits, noise, out=out, **args)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        topp_kernel.top_p_race(logits, noise, out=out, **args)
    for _ in range(3):
        fill()
        graph.replay()
        clear = boundary_gap(scaled(logits, V, 0.8).cpu(), 0.9) > BOUNDARY_GAP
        expected = topp_kernel._top_p_race_reference(logits, noise, **args)
        assert clear.sum() >= 0.9 * n
        assert torch.equal(out.cpu()[clear], expected.cpu()[clear])


def test_interpreter_subprocess() -> None:
    """The ``test_triton_*`` tests in Triton's CPU interpreter, in a child process (see the module docstring)."""
    run_interpreted(__file__)
