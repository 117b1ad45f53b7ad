"""Group collectives on 4 gloo ranks (one spawned run) against one-process references."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from distributed_utils import run_distributed
from expect import assert_within

from expertmesh.distributed.group import Group
from expertmesh.distributed.layout import ParallelLayout
from expertmesh.distributed.parallel_groups import ParallelGroups, init_groups

WORLD = 4
SIZES = [2, 0, 1, 3]  # rows per rank for the uneven collectives
SUB3 = (1, 2, 3)  # a 3-rank subgroup that leaves rank 0 out
SUB3_SIZES = [1, 0, 2]
SUB2 = (0, 2)


def _t(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _a2a_splits(n: int) -> list[list[int]]:
    # splits[i][j]: rows rank i sends to rank j (zeros included).
    return [[(i + 2 * j) % 3 for j in range(n)] for i in range(n)]


def _a2a_input(i: int, n: int) -> torch.Tensor:
    # Row = (sender, receiver, k) so the result names its own source.
    rows = [[i, j, k] for j in range(n) for k in range(_a2a_splits(n)[i][j])]
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, 3)


def _exercise(g: Group, sizes: list[int], seed: int) -> dict:
    me, n = g.rank_in_group, g.world_size
    x = _t(seed + me, 3, 4)
    splits = _a2a_splits(n)
    res = {
        "sum": g.all_reduce(x.clone()),
        "max": g.all_reduce(x.clone(), op="max"),
        "min": g.all_reduce(x.clone(), op="min"),
        "gather0": g.all_gather(x),
        "gather1": g.all_gather(x, dim=1),
        "gather_v": g.all_gather_v(_t(seed + 10 + me, sizes[me], 5), sizes, poison=True),
        "gather_v_empty": g.all_gather_v(torch.empty(0, 5), [0] * n),
        "rs_v": g.reduce_scatter_v(_t(seed + 20 + me, sum(sizes), 5), sizes, poison=True),
        "bcast": g.broadcast(_t(seed + 30 + me, 2, 2), src=n - 1),
        "a2a": g.all_to_all_single(
            _a2a_input(me, n), [splits[j][me] for j in range(n)], splits[me], poison=True
        ),
        "objs": g.all_gather_object({"me": me}),
        "bobj": g.broadcast_object(f"from{me}", src=1),
    }
    # Ring by group index: even indices send first so nobody waits on a blocked peer.
    ring = torch.full((2,), float(me))
    nxt, prv = (me + 1) % n, (me - 1) % n
    if me % 2 == 0:
        g.send(ring, dst=nxt)
        res["ring"] = g.recv(torch.empty(2), src=prv)
    else:
        res["ring"] = g.recv(torch.empty(2), src=prv)
        g.send(ring, dst=nxt)
    g.barrier()
    return res


def _collectives(rank: int, world_size: int) -> dict:
    out = {"world": _exercise(Group(tuple(range(world_size)), rank, name="world"), SIZES, 0)}
    # Every rank creates every group, in the same order.
    pg3, pg2 = dist.new_group(list(SUB3)), dist.new_group(list(SUB2))
    if rank in SUB3:
        out["sub3"] = _exercise(Group(SUB3, rank, pg3, name="sub3"), SUB3_SIZES, 100)
    if rank in SUB2:
        g2 = Group(SUB2, rank, pg2, name="sub2")
        g2.all_reduce(torch.zeros(8))  # 32 bytes: 2 * (p - 1) / p * 32 = 32 each way
        out["sub2_traffic"] = g2.traffic.snapshot()
        try:
            Group((2, 0), rank, pg2)
        except ValueError as e:
            out["order_error"] = str(e)
    return out


def _groups_of_layouts(rank: int, world_size: int, layouts: list[ParallelLayout]) -> list[dict]:
    out = []
    for layout in layouts:
        groups = init_groups(layout, rank, world_size, "gloo", timeout=timedelta(seconds=30))
        members = {}
        for kind in ("tp", "pp", "dp", "ep", "world"):
            g = groups.get(kind)
            gathered = g.all_gather(torch.tensor([rank])).tolist()
            members[kind] = (g.ranks, g.rank_in_group, tuple(gathered), g.name)
        out.append(members)
    return out


def _rank1_raises(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("boom from rank 1")
    dist.barrier()  # rank 0 would wait here for the full gloo timeout
    return rank


def _rank0_sleeps(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(60)
    return rank


def _ref(group: tuple[int, ...], sizes: list[int], seed: int) -> dict:
    n = len(group)
    xs = [_t(seed + i, 3, 4) for i in range(n)]
    rs = sum(_t(seed + 20 + i, sum(sizes), 5) for i in range(n))
    starts = [sum(sizes[:i]) for i in range(n)]
    a2a = [torch.cat([_a2a_input(j, n)[_a2a_input(j, n)[:, 1] == i] for j in range(n)]) for i in range(n)]
    return {
        "sum": [sum(xs)] * n,
        "max": [torch.stack(xs).amax(0)] * n,
        "min": [torch.stack(xs).amin(0)] * n,
        "gather0": [torch.cat(xs, 0)] * n,
        "gather1": [torch.cat(xs, 1)] * n,
        "gather_v": [torch.cat([_t(seed + 10 + i, sizes[i], 5) for i in range(n)])] * n,
        "gather_v_empty": [torch.empty(0, 5)] * n,
        "rs_v": [rs[starts[i] : starts[i] + sizes[i]] for i in range(n)],
        "bcast": [_t(seed + 30 + n - 1, 2, 2)] * n,
        "a2a": a2a,
        "objs": [[{"me": i} for i in range(n)]] * n,
        "bobj": ["from1"] * n,
        "ring": [torch.full((2,), float((i - 1) % n)) for i in range(n)],
    }


def _assert_matches(results: list[dict], key: str, group: tuple[int, ...], ref: dict) -> None:
    for i, rank in enumerate(group):
        got = results[rank][key]
        for name, expected in ref.items():
            if isinstance(expected[i], torch.Tensor):
                assert got[name].shape == expected[i].shape, (key, rank, name)
                torch.testing.assert_close(got[name], expected[i], msg=f"{key} rank {rank} {name}")
            else:
                assert got[name] == expected[i], (key, rank, name)


@pytest.fixture(scope="module")
def collective_results() -> list[dict]:
    return run_distributed(_collectives, WORLD)


@pytest.mark.timeout(60)
def test_world_group_collectives(collective_results):
    _assert_matches(collective_results, "world", tuple(range(WORLD)), _ref(tuple(range(WORLD)), SIZES, 0))


@pytest.mark.timeout(60)
def test_subgroup_collectives_use_group_indices(collective_results):
    assert "sub3" not in collective_results[0]
    _assert_matches(collective_results, "sub3", SUB3, _ref(SUB3, SUB3_SIZES, 100))


@pytest.mark.timeout(60)
def test_traffic_and_rank_order_check(collective_results):
    for rank in SUB2:
        assert collective_results[rank]["sub2_traffic"] == (32, 32, 1)
        assert "expected (2, 0)" in collective_results[rank]["order_error"]


@pytest.mark.timeout(60)
def test_init_groups_members():
    layouts = [
        ParallelLayout(2, 1, 2),
        ParallelLayout(2, 1, 2, True),
        ParallelLayout(1, 2, 2),
        ParallelLayout(4, 1, 1, True),
        ParallelLayout(1, 1, 4, True),
        ParallelLayout(2, 2, 1),
    ]
    results = run_distributed(_groups_of_layouts, WORLD, layouts)
    for li, layout in enumerate(layouts):
        for rank in range(WORLD):
            for kind, (ranks, index, gathered, name) in results[rank][li].items():
                assert ranks == layout.group_of(kind, rank), (layout, rank, kind)
                assert gathered == ranks and ranks[index] == rank
                ep_name = "ep" if layout.enable_expert_parallel else "dp_tp"
                assert name == (ep_name if kind == "ep" else kind)


def test_single_rank_group_is_identity():
    g = Group((0,), 0, name="tp")
    x = torch.randn(3, 2)
    assert g.all_reduce(x) is x and g.all_gather(x, dim=1) is x and g.broadcast(x, 0) is x
    assert g.all_gather_v(x, [3]) is x and g.reduce_scatter_v(x, [3]) is x
    assert g.all_to_all_single(x, [3], [3]) is x
    assert g.all_gather_object("a") == ["a"] and g.broadcast_object(5, 0) == 5
    g.barrier()
    assert g.traffic.snapshot() == (0, 0, 0)
    with pytest.raises(ValueError, match="sizes"):
        g.all_gather_v(x, [3, 0])
    with pytest.raises(ValueError, match="src=1"):
        g.broadcast(x, 1)
    groups = ParallelGroups.single()
    assert [groups.get(k).world_size for k in ("tp", "pp", "dp", "ep", "world")] == [1] * 5
    assert ParallelGroups.single(ParallelLayout(enable_expert_parallel=True)).ep.name == "ep"
    with pytest.raises(ValueError, match="WORLD_SIZE=1"):
        ParallelGroups.single(ParallelLayout(2))


def test_group_construction_errors():
    with pytest.raises(ValueError, match="not in ranks"):
        Group((0, 1), 2)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="torch.distributed"):
            Group((0, 1), 0)


@pytest.mark.time_bound
@pytest.mark.timeout(30)
def test_run_distributed_reports_failing_rank_quickly():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 raised:(.|\n)*boom from rank 1"):
        run_distributed(_rank1_raises, 2)
    assert_within(time.monotonic() - start, 20, "the failing rank's report")  # inside the 30 s gloo timeout


@pytest.mark.time_bound
@pytest.mark.timeout(30)
def test_run_distributed_times_out():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 3"):
        run_distributed(_rank0_sleeps, 2, timeout=3)
    assert_within(time.monotonic() - start, 15, "the 3 s timeout's report")  # rank 0 sleeps 60 s
