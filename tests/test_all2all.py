"""all2all backends on gloo ranks (one spawned run per test) against one-process references."""

from datetime import timedelta

import pytest
import torch
from distributed_utils import run_distributed

from expertmesh.config import ParallelConfig
from expertmesh.distributed.all2all import KNOWN_ALL2ALL_BACKENDS, make_all2all
from expertmesh.distributed.group import Group
from expertmesh.distributed.layout import ParallelLayout
from expertmesh.distributed.model_env import ModelEnv
from expertmesh.distributed.moe_plan import MoEPlan, expert_owners
from expertmesh.distributed.parallel_groups import ParallelGroups, init_groups
from expertmesh.layers.fused_moe import FusedExperts

WORLD = 4
BACKENDS = ["naive", "allgather_reducescatter"]
SIZES = [3, 0, 1, 5]  # tokens per rank for the raw dispatch / combine checks
HIDDEN, TOPK, EXPERTS, INTER = 6, 2, 5, 8
# MoE layouts on 4 ranks, with tokens per DP replica (0 and 1 included).
MOE_LAYOUTS = [ParallelLayout(dp, 1, 4 // dp, ep) for dp in (1, 2, 4) for ep in (False, True)]
MOE_COUNTS = [[5, 0, 1, 3], [1, 4, 0, 2]]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, hidden], topk_ids [n, k] int64, topk_weights [n, k]."""
    g = _gen(seed)
    x = torch.randn(n, HIDDEN, generator=g)
    ids = torch.zeros(n, TOPK, dtype=torch.int64)
    for row in ids:
        row.copy_(torch.randperm(EXPERTS, generator=g)[:TOPK])
    return x, ids, torch.rand(n, TOPK, generator=g)


def _experts() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(1234)
    return torch.randn(EXPERTS, HIDDEN, INTER, generator=g), torch.randn(EXPERTS, INTER, HIDDEN, generator=g)


def _moe(x, ids, weights, experts: list[int], inter: slice) -> torch.Tensor:
    """Toy MoE over the given experts and intermediate slice: [n, hidden] partial result."""
    w1, w2 = _experts()
    y = torch.zeros_like(x)
    for e in experts:
        gate = (weights * (ids == e)).sum(-1, keepdim=True)  # [n, 1]
        y += gate * (torch.relu(x @ w1[e][:, inter]) @ w2[e][inter, :])
    return y


def _off_by_one(sizes: list[int], rank: int) -> list[int]:
    # Every rank's own entry is wrong, so every rank fails before any collective.
    return [s + (i == rank) for i, s in enumerate(sizes)]


def _raw_checks(rank: int, world_size: int) -> dict:
    group = Group(tuple(range(world_size)), rank, name="ep")
    x, ids, w = _tokens(rank, SIZES[rank])
    y_all = torch.randn(sum(SIZES), HIDDEN, generator=_gen(100 + rank))
    out = {}
    for name in BACKENDS:
        for poison in (False, True):
            a2a = make_all2all(name, group, poison_recv=poison)
            out[name, poison] = (a2a.dispatch(x, ids, w, SIZES), a2a.combine(y_all, SIZES), dict(a2a.stats))
        errors = []
        for bad in ([3, 0, 1], SIZES + [0], _off_by_one(SIZES, rank)):
            try:
                a2a.dispatch(x, ids, w, bad)
            except ValueError as e:
                errors.append(str(e))
        try:
            a2a.combine(y_all, [3, 0, 1])
        except ValueError as e:
            errors.append(str(e))
        out[name, "errors"] = errors
    return out


def _moe_rank(rank: int, world_size: int, layout: ParallelLayout, counts: list[int], backend: str):
    """One MoE forward the way the plan says; returns this rank's output for its replica."""
    groups = init_groups(layout, rank, world_size, "gloo", timeout=timedelta(seconds=30))
    plan = MoEPlan.decide(layout, rank)
    dp = layout.coords(rank)[0]
    n = counts[dp]
    x, ids, w = _tokens(dp, n)  # identical on the TP ranks of one replica
    if plan.expert_parallel:
        experts, inter = plan.local_experts(EXPERTS), slice(None)
    else:
        chunk = INTER // plan.weight_shard_size
        experts, inter = (
            list(range(EXPERTS)),
            slice(plan.weight_shard_rank * chunk, (plan.weight_shard_rank + 1) * chunk),
        )
    if plan.sequence_parallel:
        rows = plan.sp_slice(n)
        x, ids, w = x[rows], ids[rows], w[rows]
    if plan.dispatch_group_name is None:
        y = _moe(x, ids, w, experts, inter)
    else:
        owner = torch.tensor(expert_owners(EXPERTS, plan.weight_shard_size))  # [E] EP ranks
        a2a = make_all2all(backend, groups.get(plan.dispatch_group_name), True, owner)
        sizes = a2a.group.all_gather_object(x.shape[0])
        y = a2a.combine(_moe(*a2a.dispatch(x, ids, w, sizes), experts, inter), sizes)
    if plan.reduce_after == "tp_all_reduce":
        y = groups.tp.all_reduce(y)
    elif plan.reduce_after == "tp_all_gather":
        y = groups.tp.all_gather_v(y, plan.sp_sizes(n))
    return y


def _moe_backends(layout: ParallelLayout) -> list[str]:
    """alltoall needs EP and exists only where tokens are exchanged (DP > 1)."""
    return BACKENDS + ["alltoall"] if layout.enable_expert_parallel and layout.dp > 1 else BACKENDS


def _moe_all(rank: int, world_size: int) -> dict:
    return {
        (li, ci, backend): _moe_rank(rank, world_size, layout, counts, backend)
        for li, layout in enumerate(MOE_LAYOUTS)
        for ci, counts in enumerate(MOE_COUNTS)
        for backend in _moe_backends(layout)
    }


@pytest.fixture(scope="module")
def raw_results() -> list[dict]:
    return run_distributed(_raw_checks, WORLD)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", BACKENDS)
def test_dispatch_combine_match_reference(raw_results, name):
    toks = [_tokens(r, SIZES[r]) for r in range(WORLD)]
    ref_dispatch = [torch.cat([t[i] for t in toks]) for i in range(3)]
    y_sum = sum(torch.randn(sum(SIZES), HIDDEN, generator=_gen(100 + r)) for r in range(WORLD))
    for rank in range(WORLD):
        start = sum(SIZES[:rank])
        for poison in (False, True):
            (disp, comb, stats) = raw_results[rank][name, poison]
            for got, want in zip(disp, ref_dispatch, strict=True):
                assert got.dtype == want.dtype
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            torch.testing.assert_close(comb, y_sum[start : start + SIZES[rank]])
            assert stats["calls"] == 2 and stats["bytes_received"] > 0
    naive, agrs = (raw_results[0][b, False] for b in BACKENDS)
    torch.testing.assert_close(naive[1], agrs[1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", BACKENDS)
def test_wrong_sizes_fail_loudly(raw_results, name):
    for rank in range(WORLD):
        errors = raw_results[rank][name, "errors"]
        assert len(errors) == 4, errors
        assert "len(sizes)=3 but the group has 4 ranks" in errors[0]
        assert "len(sizes)=5 but the group has 4 ranks" in errors[1]
        assert f"sizes[{rank}]=" in errors[2] and "local tensor has" in errors[2]
        assert "len(sizes)=3" in errors[3]


@pytest.mark.timeout(60)
def test_moe_every_layout_equals_one_process():
    results = run_distributed(_moe_all, WORLD)
    for li, layout in enumerate(MOE_LAYOUTS):
        for ci, counts in enumerate(MOE_COUNTS):
            for rank in range(WORLD):
                dp = layout.coords(rank)[0]
                x, ids, w = _tokens(dp, counts[dp])
                want = _moe(x, ids, w, list(range(EXPERTS)), slice(None))
                for backend in _moe_backends(layout):
                    got = results[rank][li, ci, backend]
                    where = f"{layout} counts={counts} {backend} rank {rank}"
                    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=where)


def test_registry():
    group = Group((0,), 0)
    assert set(KNOWN_ALL2ALL_BACKENDS) == {"naive", "allgather_reducescatter", "alltoall"}
    with pytest.raises(ValueError, match="naive, allgather_reducescatter, alltoall"):
        make_all2all("deepep", group)
    with pytest.raises(ValueError, match="'alltoall' requires enable_expert_parallel=True"):
        make_all2all("alltoall", group)
    with pytest.raises(ValueError, match="expert_owner must be"):
        make_all2all("alltoall", group, expert_owner=torch.tensor([0, 1]))  # rank 1 of 1
    for name in BACKENDS + ["alltoall"]:
        a2a = make_all2all(name, group, expert_owner=torch.zeros(EXPERTS, dtype=torch.int64))
        x, ids, w = _tokens(0, 3)
        assert all(a is b for a, b in zip(a2a.dispatch(x, ids, w, [3]), (x, ids, w), strict=True))
        assert a2a.combine(x, [3]) is not None and a2a.stats["bytes_sent"] == 0
        with pytest.raises(ValueError, match="len\\(sizes\\)=2"):
            a2a.dispatch(x, ids, w, [3, 0])


# --- alltoall: each token only to its experts' owners ------------------------------------------

# (num_experts, placement, tokens per EP rank): top-2 routing, uneven loads with 0 and 1.
A2A_CASES = {
    2: [
        (8, "contiguous", [5, 0]),
        (7, "contiguous", [1, 9]),
        (7, "round_robin", [4, 3]),
        (8, "contiguous", [0, 0]),
    ],
    4: [(8, "contiguous", [3, 0, 1, 6]), (7, "contiguous", [0, 7, 2, 1]), (7, "round_robin", [2, 5, 0, 3])],
}
A2A_INTER = 8


def _routed(seed: int, n: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, hidden], topk_ids [n, k] (distinct experts), topk_weights [n, k]."""
    g = _gen(seed)
    x = torch.randn(n, HIDDEN, generator=g)
    ids = torch.rand(n, num_experts, generator=g).argsort(1)[:, :TOPK]  # distinct per row
    return x, ids, torch.rand(n, TOPK, generator=g)


def _fused(num_experts: int, experts: list[int]) -> FusedExperts:
    """FusedExperts holding ``experts`` whole, weights drawn per expert from one seeded set."""
    g = _gen(4321 + num_experts)
    w13 = torch.randn(num_experts, 2 * A2A_INTER, HIDDEN, generator=g) / 4  # [E, 2I, H]
    w2 = torch.randn(num_experts, HIDDEN, A2A_INTER, generator=g) / 4  # [E, H, I]
    fe = FusedExperts(num_experts, experts, HIDDEN, A2A_INTER, 0, 1, "silu")
    fe.w13.data.copy_(w13[experts])
    fe.w2.data.copy_(w2[experts])
    return fe


def _a2a_rank(rank: int, world_size: int) -> dict:
    group = Group(tuple(range(world_size)), rank, name="ep")
    out = {}
    for ci, (num_experts, placement, sizes) in enumerate(A2A_CASES[world_size]):
        owners = expert_owners(num_experts, world_size, placement)
        experts = _fused(num_experts, [e for e, o in enumerate(owners) if o == rank])
        x, ids, w = _routed(10 * ci + rank, sizes[rank], num_experts)
        a2a = make_all2all("alltoall", group, poison_recv=True, expert_owner=torch.tensor(owners))
        recv = a2a.dispatch(x, ids, w, sizes)
        y = a2a.combine(experts(*recv), sizes)
        agrs = make_all2all("allgather_reducescatter", group)
        y_agrs = agrs.combine(experts(*agrs.dispatch(x, ids, w, sizes)), sizes)
        out[ci] = (recv, y, y_agrs, dict(a2a.stats))
    return out


def _a2a_errors(rank: int, world_size: int) -> list[str]:
    group = Group(tuple(range(world_size)), rank, name="ep")
    a2a = make_all2all("alltoall", group, expert_owner=torch.tensor(expert_owners(8, world_size)))
    x, ids, w = _routed(rank, 2, 8)
    sizes = [2] * world_size
    errors = []
    for call in (
        lambda: a2a.combine(x, sizes),  # no dispatch before it
        lambda: a2a.dispatch(x, ids, w, sizes[:-1]),
        lambda: a2a.dispatch(x, ids, w, _off_by_one(sizes, rank)),
        lambda: a2a.combine(a2a.dispatch(x, ids, w, sizes)[0][:-1], sizes),  # rows != received
    ):
        try:
            call()
        except (ValueError, RuntimeError) as e:
            errors.append(str(e))
    a2a.combine(a2a.dispatch(x, ids, w, sizes)[0], sizes)  # a fresh pair still works
    return errors


def _check_a2a(world_size: int) -> None:
    results = run_distributed(_a2a_rank, world_size)
    for ci, (num_experts, placement, sizes) in enumerate(A2A_CASES[world_size]):
        owners = torch.tensor(expert_owners(num_experts, world_size, placement))
        everything = _fused(num_experts, list(range(num_experts)))
        toks = [_routed(10 * ci + r, sizes[r], num_experts) for r in range(world_size)]
        for rank in range(world_size):
            (x_recv, ids_recv, w_recv), y, y_agrs, stats = results[rank][ci]
            where = f"EP {world_size} case {ci} rank {rank}"
            # Received: the tokens with an expert here, once each, by source rank then order.
            keep = [(owners[t[1]] == rank).any(1) for t in toks]
            for got, i in ((x_recv, 0), (ids_recv, 1), (w_recv, 2)):
                want = torch.cat([t[i][k] for t, k in zip(toks, keep, strict=True)])
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=where)
            want = everything(*toks[rank])  # one process, all experts local
            torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5, msg=where)
            torch.testing.assert_close(y, y_agrs, atol=1e-5, rtol=1e-5, msg=where)
            assert stats["calls"] == 2, where


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_alltoall_matches_one_process_and_allgather(world_size):
    _check_a2a(world_size)


@pytest.mark.timeout(60)
def test_alltoall_pairing_and_sizes_fail_loudly():
    for rank, errors in enumerate(run_distributed(_a2a_errors, 2)):
        assert len(errors) == 4, errors
        assert "without a dispatch before it" in errors[0]
        assert "len(sizes)=1 but the group has 2 ranks" in errors[1]
        assert f"sizes[{rank}]=3" in errors[2] and "local tensor has 2 rows" in errors[2]
        assert "rows but dispatch handed out" in errors[3]


def test_alltoall_needs_expert_parallel_at_config_construction():
    """The rule is checked once, by ParallelConfig (any DP size, before any process group)."""
    for dp in (1, 2):
        with pytest.raises(
            ValueError, match="all2all_backend='alltoall' requires enable_expert_parallel=True"
        ):
            ParallelConfig(data_parallel_size=dp, all2all_backend="alltoall")
        assert ParallelConfig(data_parallel_size=dp, enable_expert_parallel=True, all2all_backend="alltoall")
    layout = ParallelLayout(1, 1, 1, True)
    env = ModelEnv(ParallelGroups.single(layout), MoEPlan.decide(layout, 0), "alltoall", range(1))
    assert env.make_dispatcher(EXPERTS) is None  # EP with DP=1: nothing to exchange
