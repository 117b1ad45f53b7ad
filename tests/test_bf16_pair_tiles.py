"""bf16 pair products (AVX512-BF16, cpu/csrc/bf16_pairs.c) at every tile shape they pick.

Products pick their tiles by row count: 1-3 rows in wide one-pass tiles (4-6 panels), more in
8 x 3 tiles whose first row tile streams the weights (narrower tiles for a group's last panels);
the experts' gate and up products in gated tiles (12 rows x (1 + 1) panels, the activation in
the tile) when the intermediate size is a multiple of 16, else the plain tiles and a pass over
float32 rows. Every output is the same chain of pair products whatever tile computes it, so a
row alone equals that row inside any batch bit for bit; values are checked against float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

BF16 = torch.bfloat16


@pytest.fixture
def pairs(kernels):
    if not kernels.bf16_pairs:
        pytest.skip("no AVX512-BF16 pair products on this CPU")
    return kernels


# (out, in): 213 = 13 panels and 5 (14 panels: a 12-panel span and 2; four groups of 3 and 2);
# 13: one partial panel; odd `in` (rows copied into pairs, the last padded) and even (read in place)
SHAPES = [(213, 64), (213, 37), (13, 1), (48, 2), (100, 130)]


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_pair_linear_every_row_count(pairs, out_features, in_features):
    """Rows 0-50 (wide tiles, 8-row tiles and every remainder): float32 outputs within float32
    rounding of float64, bf16 outputs those rounded, and each row the same bits at every count."""
    g = torch.Generator().manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features, generator=g).to(BF16)
    b = torch.randn(out_features, generator=g).to(BF16)
    packed = pairs.pack(w)
    x = torch.randn(50, in_features, generator=g).to(BF16)
    truth = F.linear(x.double(), w.double(), b.double())
    bound = 1e-5 * (x.double().abs() @ w.double().abs().t() + b.double().abs()) + 1e-30
    full = pairs.linear(x, packed, b, out_dtype=torch.float32)
    full16 = pairs.linear(x, packed, b)
    for m in range(51):
        got = pairs.linear(x[:m], packed, b, out_dtype=torch.float32)
        assert got.shape == (m, out_features) and got.dtype == torch.float32
        assert ((got.double() - truth[:m]).abs() <= bound[:m]).all(), m
        assert torch.equal(got, full[:m]), m  # the rows of any count: the same bits
        got16 = pairs.linear(x[:m], packed, b)
        assert torch.equal(got16, got.to(BF16)) and torch.equal(got16, full16[:m]), m
    without = pairs.linear(x[:5], packed, out_dtype=torch.float32)
    assert ((without.double() - F.linear(x[:5].double(), w.double())).abs() <= bound[:5]).all()


def _routing(counts: list[int], k: int, g: torch.Generator) -> torch.Tensor:
    """Expert ids [n, k] giving expert e exactly counts[e] (token, choice) pairs, a token's choices
    distinct (no expert has more than n = sum / k pairs), tokens shuffled."""
    slots = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    ids = slots.view(k, -1).t()
    assert all(len(set(row.tolist())) == k for row in ids)
    return ids[torch.randperm(ids.shape[0], generator=g)]


def _reference(x, slot, wts, w13, w2, b13, b2, act) -> torch.Tensor:
    """The kernel's plan in float64: h = x @ w13.T + b13 rounded to bf16, the activation in float32
    rounded to bf16, a @ w2.T + b2, summed over a token's experts with their weights."""
    n, hidden = x.shape
    out = torch.zeros(n, hidden, dtype=torch.float64)
    for t in range(n):
        for j in range(slot.shape[1]):
            e = int(slot[t, j])
            if e < 0:
                continue
            h = (w13[e].double() @ x[t].double() + b13[e].double()).float().to(BF16).float()
            a = act(h).to(BF16).double()
            out[t] += float(wts[t, j]) * (w2[e].double() @ a + b2[e].double())
    return out


def _gated(name: str):
    def act(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2)
        if name == "silu":
            return F.silu(gate) * up
        return F.gelu(gate, approximate="tanh" if name == "gelu_pytorch_tanh" else "none") * up

    return act


def _clamped(limit: float, alpha: float):
    def act(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return act


# 48, 112: gated tiles (3 and 7 gate panels: spans of 6 and what is left); 40, 17: plain tiles
# and the activation pass (17: odd, its pairs padded)
@pytest.mark.parametrize("inter", [48, 112, 40, 17])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "swiglu_clamped"])
@pytest.mark.parametrize("k", [1, 2])
def test_pair_experts_every_rows_per_expert(pairs, inter, act, k):
    """Experts receiving 0-3 rows (wide tiles), 4-13 (8- and 12-row tiles and remainders), 25 and
    51 (several row tiles), one expert none, some pairs another rank's (-1); hidden 99 (an odd
    width, its last panel partial); with biases for the clamped SwiGLU (moe_bf16_ex's extras).
    Against float64 on the same bf16 weights, and each token alone as in the batch, bit for bit."""
    g = torch.Generator().manual_seed(inter * 10 + k)
    hidden = 99
    counts = [0, 1, 2, 3, 4, 7, 8, 12, 13, 25, 51] if k == 2 else [0, 1, 2, 3, 5, 6, 8, 11, 12, 13, 26]
    e = len(counts)
    ids = _routing(counts, k, g).to(torch.int32)
    ids[3, 0] = -1  # another rank's expert
    n = ids.shape[0]
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) * hidden**-0.5).to(BF16)
    w2 = (torch.randn(e, hidden, inter, generator=g) * inter**-0.5).to(BF16)
    x = torch.randn(n, hidden, generator=g).to(BF16)
    wts = torch.rand(n, k, generator=g)
    p13 = torch.stack([pairs.pack(w13[i]).data for i in range(e)])
    p2 = torch.stack([pairs.pack(w2[i]).data for i in range(e)])
    extras, b13, b2 = None, torch.zeros(e, 2 * inter), torch.zeros(e, hidden)
    if act == "swiglu_clamped":  # gate and up cross the clamp (h about N(0, 1) + bias)
        b13, b2 = torch.randn(e, 2 * inter, generator=g), torch.randn(e, hidden, generator=g)
        extras = (b13, b2, 1.5, 1.702)
        fn = _clamped(1.5, 1.702)
    else:
        fn = _gated(act)
    got = pairs.moe(x, ids, wts, p13, p2, inter, act, extras)
    truth = _reference(x, ids, wts, w13, w2, b13, b2, fn)
    scale = truth.abs().max().item()
    assert (got.double() - truth).abs().max().item() <= 2**-7 * scale + 1e-3
    for t in range(n):  # one row for each of its experts: the one-row tiles
        alone = pairs.moe(x[t : t + 1], ids[t : t + 1], wts[t : t + 1], p13, p2, inter, act, extras)
        assert torch.equal(alone, got[t : t + 1]), t
