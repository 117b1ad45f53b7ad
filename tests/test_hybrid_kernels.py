"""The recurrent mixers' decode kernels (cpu/csrc/recurrent.c, cpu/recurrent_kernels.py) against
the mixers' torch path, on the native build and on the one without AVX-512: the convolution step
and Mamba2's state update bit for bit, the Gated DeltaNet step and Mamba2's output within a float32
bound derived from their dot products; uneven batches over scattered slots, a batch of one, an
empty batch; slots not in the batch stay untouched; several steps in a row."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.cpu.ops import ops_for
from expertmesh.cpu.recurrent_kernels import RecurrentKernels
from expertmesh.distributed.fixed_sum import plain
from expertmesh.layers.gated_deltanet import GatedDeltaNet
from expertmesh.layers.mamba2 import Mamba2Mixer
from expertmesh.layers.recurrent_mixer import RecurrentMixer
from expertmesh.layers.torch_ops import TORCH_OPS

U = 2.0**-24  # float32's unit roundoff
SLOTS = 7  # state rows (slots + the dummy row)
BATCHES = [[4, 0, 6], [3], [], [5, 1, 2, 0, 6, 3, 4]]  # uneven, one, empty, every slot


@pytest.fixture(params=["native", "generic"])
def built(request):
    """The compiled library of the native build and of the -mno-avx512f one (conftest's fixtures)."""
    return request.getfixturevalue("kernels" if request.param == "native" else "generic_kernels")


@pytest.fixture
def rk(built) -> RecurrentKernels:
    bound = RecurrentKernels.bind(built)
    assert bound is not None, "the library has the recurrent entry points"
    return bound


class Conv(RecurrentMixer):
    """A mixer with only the convolution: what RecurrentMixer's conv methods read."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype, g: torch.Generator):
        super().__init__()
        self.conv_dim, self.kernel = channels, kernel
        self.conv_weight = nn.Parameter(torch.randn(channels, kernel, generator=g).to(dtype), False)
        b = nn.Parameter(torch.randn(channels, generator=g).to(dtype), False) if bias else None
        self.register_parameter("conv_bias", b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel, bias", [(4, False), (4, True), (2, True)])
def test_conv_step_equals_the_torch_path_bit_for_bit(built, dtype, kernel, bias):
    """Output (after SiLU, in the model dtype) and the shifted conv states equal; other slots
    unchanged. States hold model-dtype values, as the engine's do (its inputs were rounded)."""
    g = torch.Generator().manual_seed(kernel)
    channels = 37  # not a multiple of any vector width
    conv = Conv(channels, kernel, bias, dtype, g)
    conv.use_ops(TORCH_OPS)
    assert conv.recurrent_steps is None  # no library: the torch path
    conv.use_ops(ops_for(built))
    state = torch.randn(SLOTS, channels, kernel - 1, generator=g).to(dtype).float()
    conv.bind_state((state, torch.zeros(SLOTS, 1)))
    for step, batch in enumerate(BATCHES * 2):  # each batch twice: the second from shifted states
        slots = torch.tensor(batch, dtype=torch.int64)
        x = torch.randn(len(batch), channels, generator=g).to(dtype)
        before = state.clone()
        ref, ref_state = conv._conv_decode(x, before[slots])
        out = conv._conv_decode_in_place(x, slots)
        assert out.dtype == dtype and torch.equal(out, ref), (step, batch)
        assert torch.equal(state[slots], ref_state), (step, batch)
        others = [s for s in range(SLOTS) if s not in batch]
        assert torch.equal(state[others], before[others])


def _gdn(nk: int, nv: int, dk: int, dv: int) -> SimpleNamespace:
    """What GatedDeltaNet._delta reads of its module."""
    return SimpleNamespace(
        nk=nk, nv=nv, dk=dk, dv=dv, ratio=nv // nk, key_dim=nk * dk, value_dim=nv * dv, pw=plain
    )


def _gdn_bounds(mixed, decay, beta, state, nk, dk, dv):
    """Bounds on |kernel - torch| for one step, each path's float32 error from the exact step
    (first order in u, from the same inputs), summed. With k and q normalised (each within
    (dk + 4) u relative: a sum of dk squares, a square root, a division, a scale), e = exp(g):
      kv_j = sum_i (e S_ij) k_i, dk products:      error <= (2 dk + 6) u sum_i |e S_ij k_i|
      delta_j = (v_j - kv_j) beta:                 error <= (2 dk + 8) u beta A_j,
                                                   A_j = sum_i |e S_ij k_i| + |v_j|
      S'_ij = e S_ij + k_i delta_j:                error <= (3 dk + 16) u M_ij,
                                                   M_ij = |e S_ij| + |k_i| beta A_j
      out_j = sum_i S'_ij q_i:                     error <= (5 dk + 20) u sum_i M_ij |q_i|."""
    t, nv = mixed.shape[0], state.shape[1]
    q, k, v = mixed.double().split([nk * dk, nk * dk, nv * dv], dim=-1)

    def norm(x):
        x = x.reshape(t, nk, dk)
        return (x / (x * x).sum(-1, keepdim=True).add(1e-6).sqrt()).repeat_interleave(nv // nk, dim=1)

    q, k, v = norm(q).abs() * dk**-0.5, norm(k).abs(), v.reshape(t, nv, dv).abs()
    es = (state.double() * decay.double()[..., None, None]).abs()  # [t, nv, dk, dv]
    a = (es * k[..., None]).sum(-2) + v  # [t, nv, dv]
    m = es + k[..., None] * (beta.double()[..., None] * a)[..., None, :]
    return 2 * (3 * dk + 16) * U * m, 2 * (5 * dk + 20) * U * (m * q[..., None]).sum(-2)


@pytest.mark.parametrize("nk, nv, dk, dv", [(2, 4, 16, 16), (1, 3, 32, 24), (2, 2, 128, 128)])
def test_gated_deltanet_step_within_its_float32_bound(rk, nk, nv, dk, dv):
    """GatedDeltaNet._delta's decode (l2norm, repeat per value head, delta_rule_step) against
    gdn_step on the states in their slots, step after step; the bound (_gdn_bounds) is tens of
    thousands of times below what a wrong head, slot or sign moves."""
    g = torch.Generator().manual_seed(dk + nv)
    mod = _gdn(nk, nv, dk, dv)
    state = torch.randn(SLOTS, nv, dk, dv, generator=g) * 0.5
    for step, batch in enumerate(BATCHES * 2):
        slots = torch.tensor(batch, dtype=torch.int64)
        t = len(batch)
        mixed = torch.randn(t, 2 * nk * dk + nv * dv, generator=g)
        gate = -torch.rand(t, nv, generator=g) * 2
        beta = torch.rand(t, nv, generator=g)
        before = state.clone()
        ref_state = before[slots]
        ref = GatedDeltaNet._delta(mod, mixed, gate, beta, ref_state)
        out = rk.gdn_step(mixed, gate.exp(), beta, state, slots, nk)
        s_bound, o_bound = _gdn_bounds(mixed, gate.exp(), beta, before[slots], nk, dk, dv)
        assert out.shape == ref.shape == (t, nv, dv)
        assert ((out - ref).abs() <= o_bound).all(), (step, batch, (out - ref).abs().max())
        assert ((state[slots] - ref_state).abs() <= s_bound).all(), (step, batch)
        others = [s for s in range(SLOTS) if s not in batch]
        assert torch.equal(state[others], before[others])
        if t:  # the bound is far below an error: a swapped pair of value heads breaks it
            swapped = ref[:, [1, 0, *range(2, nv)]]
            assert not ((out - swapped).abs() <= o_bound).all()


@pytest.mark.parametrize("length", [1, 5, 70])
def test_gated_deltanet_prefill_scan_equals_its_tokens_stepped(rk, length):
    """A prefill chunk of one sequence (one slot, `length` tokens, the scan) equals its tokens fed
    one at a time to the decode step, bit for bit (the same per-head body), so the step's bound
    against the torch path holds token by token; other slots untouched."""
    nk, nv, dk, dv = 2, 4, 32, 16
    g = torch.Generator().manual_seed(length)
    state = torch.randn(SLOTS, nv, dk, dv, generator=g) * 0.5
    stepped = state.clone()
    mixed = torch.randn(length, 2 * nk * dk + nv * dv, generator=g)
    decay, beta = torch.rand(length, nv, generator=g), torch.rand(length, nv, generator=g)
    slot = torch.tensor([3])
    out = rk.gdn_step(mixed, decay, beta, state, slot, nk)
    ref = torch.cat([rk.gdn_step(mixed[i : i + 1], decay[i : i + 1], beta[i : i + 1], stepped, slot, nk)
                     for i in range(length)])  # fmt: skip
    assert out.shape == (length, nv, dv) and torch.equal(out, ref)
    assert torch.equal(state, stepped) and not torch.equal(state[3], torch.zeros_like(state[3]))
    five = (torch.randn(5, mixed.shape[1]), torch.rand(5, nv), torch.rand(5, nv))
    with pytest.raises(ValueError, match="2 state slots for 5 tokens"):
        rk.gdn_step(*five, state, torch.tensor([1, 2]), nk)


def _mamba(heads: int, head_dim: int, n: int, groups: int, g: torch.Generator) -> SimpleNamespace:
    """What Mamba2Mixer._ssm and _ssm_in_place read of their module."""
    return SimpleNamespace(
        m=SimpleNamespace(head_dim=head_dim, state_size=n), groups=groups, heads=heads,
        inter=heads * head_dim, A_log=torch.rand(heads, generator=g), D=torch.randn(heads, generator=g),
        pw=plain,
    )  # fmt: skip


@pytest.mark.parametrize("heads, head_dim, n, groups", [(8, 16, 8, 4), (4, 8, 20, 1), (8, 64, 128, 8)])
def test_mamba2_step_equals_the_torch_path(rk, heads, head_dim, n, groups):
    """Mamba2Mixer._ssm's decode against ssm_step on the states in their slots: states equal bit
    for bit (the same roundings: S e, then + (dt x) b), y = S C + D x within the bound of an
    N-term dot product computed in two orders, each within (N + 2) u sum_n |S_pn C_n| + u |D x_p|
    of the exact one."""
    g = torch.Generator().manual_seed(n)
    mod = _mamba(heads, head_dim, n, groups, g)
    state = torch.randn(SLOTS, heads, head_dim, n, generator=g)
    mod.rec_state, mod.recurrent_steps = state, rk
    for step, batch in enumerate(BATCHES * 2):
        slots = torch.tensor(batch, dtype=torch.int64)
        t = len(batch)
        xbc = torch.randn(t, heads * head_dim + 2 * groups * n, generator=g)
        dt = F.softplus(torch.randn(t, heads, generator=g))
        before = state.clone()
        ref_state = before[slots]
        ref = Mamba2Mixer._ssm(mod, xbc, dt, ref_state)
        out = Mamba2Mixer._ssm_in_place(mod, xbc, dt, slots)
        assert torch.equal(state[slots], ref_state), (step, batch)
        c = xbc[:, heads * head_dim + groups * n :].view(t, groups, n).repeat_interleave(heads // groups, 1)
        inter = heads * head_dim
        dot = (ref_state.double().abs() * c.double().abs()[:, :, None, :]).sum(-1).reshape(t, inter)
        skip = (mod.D.double()[:, None] * xbc[:, :inter].double().view(t, heads, head_dim)).abs()
        bound = 2 * ((n + 2) * U * dot + U * skip.reshape(t, inter))
        assert out.shape == ref.shape == (t, heads * head_dim)
        assert ((out - ref).abs() <= bound).all(), (step, batch, (out - ref).abs().max())
        others = [s for s in range(SLOTS) if s not in batch]
        assert torch.equal(state[others], before[others])


@pytest.mark.parametrize("length", [1, 5, 70])
def test_mamba2_prefill_scan_equals_its_tokens_stepped(rk, length):
    """Mamba2's prefill chunk on one slot (the scan) equals its tokens fed one at a time to the
    decode step, bit for bit, states and outputs; other slots untouched."""
    heads, head_dim, n, groups = 8, 16, 24, 2
    g = torch.Generator().manual_seed(length)
    state = torch.randn(SLOTS, heads, head_dim, n, generator=g)
    stepped = state.clone()
    xbc = torch.randn(length, heads * head_dim + 2 * groups * n, generator=g)
    dt, decay, d = (
        torch.rand(length, heads, generator=g),
        torch.rand(length, heads, generator=g),
        torch.randn(heads),
    )
    slot = torch.tensor([5])
    out = rk.ssm_step(xbc, dt, decay, d, state, slot, groups)
    ref = torch.cat([rk.ssm_step(xbc[i : i + 1], dt[i : i + 1], decay[i : i + 1], d, stepped, slot, groups)
                     for i in range(length)])  # fmt: skip
    assert out.shape == (length, heads * head_dim) and torch.equal(out, ref)
    assert torch.equal(state, stepped)
    with pytest.raises(ValueError, match="3 state slots for 2 tokens"):
        rk.ssm_step(xbc[:1].expand(2, -1), dt[:1].expand(2, -1), decay[:1].expand(2, -1), d, state,
                    torch.tensor([1, 2, 3]), groups)  # fmt: skip


def test_bad_states_and_slots_are_refused_by_name(kernels):
    """A state the kernels cannot address, or a slot outside it, is refused before any C runs;
    the next call works."""
    rk = RecurrentKernels.bind(kernels)
    mixed, ones = torch.randn(1, 2 * 16 + 2 * 16), torch.ones(1, 2)
    state = torch.zeros(SLOTS, 2, 16, 16)
    with pytest.raises(ValueError, match="outside the state's 7 rows"):
        rk.gdn_step(mixed, ones, ones, state, torch.tensor([SLOTS]), 1)
    with pytest.raises(ValueError, match="contiguous float32 CPU state"):
        rk.gdn_step(mixed, ones, ones, state.double(), torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="int64"):
        rk.gdn_step(mixed, ones, ones, state, torch.tensor([0], dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="mixed width 64 does not match 2 key"):
        rk.gdn_step(mixed, ones, ones, state, torch.tensor([0]), 2)
    assert rk.gdn_step(mixed, ones, ones, state, torch.tensor([0]), 1).shape == (1, 2, 16)
