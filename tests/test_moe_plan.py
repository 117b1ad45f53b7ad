import pytest
import torch

from expertmesh.distributed.layout import ParallelLayout
from expertmesh.distributed.moe_plan import MoEPlan, expert_owners


def _layout(dp: int, pp: int, tp: int, ep: bool) -> ParallelLayout:
    return ParallelLayout(
        data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp, enable_expert_parallel=ep
    )


# (DP, PP, TP, EP), global rank -> (mode, shard rank, shard size, dispatch group, after)
TABLE = [
    ((1, 1, 1, False), 0, ("tp", 0, 1, None, "tp_all_reduce")),
    ((1, 1, 4, False), 2, ("tp", 2, 4, None, "tp_all_reduce")),
    ((1, 2, 2, False), 3, ("tp", 1, 2, None, "tp_all_reduce")),
    ((2, 1, 2, False), 3, ("dp_tp", 3, 4, "dp", "tp_all_reduce")),
    ((2, 1, 2, False), 2, ("dp_tp", 2, 4, "dp", "tp_all_reduce")),
    ((2, 2, 2, False), 6, ("dp_tp", 2, 4, "dp", "tp_all_reduce")),  # rank 6 = (dp1, pp1, tp0)
    ((4, 1, 1, False), 3, ("dp_tp", 3, 4, "dp", "tp_all_reduce")),
    ((1, 1, 4, True), 1, ("ep", 1, 4, None, "tp_all_reduce")),
    ((1, 1, 1, True), 0, ("ep", 0, 1, None, "tp_all_reduce")),
    ((4, 1, 1, True), 2, ("ep", 2, 4, "ep", "none")),
    ((2, 2, 1, True), 3, ("ep", 1, 2, "ep", "none")),  # rank 3 = (dp1, pp1)
    ((2, 1, 2, True), 1, ("ep_sp", 1, 4, "ep", "tp_all_gather")),
    ((2, 2, 2, True), 5, ("ep_sp", 3, 4, "ep", "tp_all_gather")),  # rank 5 = (dp1, pp0, tp1)
]


@pytest.mark.parametrize(("sizes", "rank", "expected"), TABLE)
def test_plan_table(sizes, rank, expected):
    plan = MoEPlan.decide(_layout(*sizes), rank)
    got = (plan.mode, plan.weight_shard_rank, plan.weight_shard_size, plan.dispatch_group_name)
    assert got + (plan.reduce_after,) == expected
    assert plan.tp_rank == _layout(*sizes).coords(rank)[2]


@pytest.mark.parametrize("sizes", [(1, 1, 2), (2, 1, 2), (2, 2, 2), (3, 1, 1), (1, 3, 2), (3, 2, 2)])
@pytest.mark.parametrize("ep", [False, True])
def test_shard_rank_is_index_in_ep_group(sizes, ep):
    # The shard rank must be the rank's index in the group that holds the shards (same pp).
    layout = _layout(*sizes, ep)
    for rank in range(layout.world_size):
        plan = MoEPlan.decide(layout, rank)
        group = layout.group_of("ep", rank)
        assert (plan.weight_shard_rank, plan.weight_shard_size) == (group.index(rank), len(group))


def test_sequence_parallel_slices():
    plan = MoEPlan.decide(_layout(2, 1, 2, True), 1)
    assert plan.sp_sizes(5) == [3, 2]
    assert plan.sp_sizes(1) == [1, 0]
    assert plan.sp_sizes(0) == [0, 0]
    assert plan.sp_slice(5) == slice(3, 5)
    assert plan.sp_slice(1) == slice(1, 1)
    plan3 = MoEPlan.decide(_layout(2, 1, 3, True), 2)
    assert plan3.sp_sizes(4) == [2, 2, 0]
    assert plan3.sp_sizes(7) == [3, 3, 1]
    assert plan3.sp_slice(7) == slice(6, 7)
    with pytest.raises(ValueError, match="ep_sp"):
        MoEPlan.decide(_layout(2, 1, 2, False), 0).sp_sizes(3)


def test_local_experts_uneven():
    assert expert_owners(10, 4) == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert expert_owners(10, 4, "round_robin") == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    layout = _layout(4, 1, 1, True)
    contiguous = [MoEPlan.decide(layout, r).local_experts(10) for r in range(4)]
    assert contiguous == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    rr = [MoEPlan.decide(layout, r).local_experts(10, "round_robin") for r in range(4)]
    assert rr == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    # Fewer experts than ranks: the last rank holds none.
    assert [MoEPlan.decide(layout, r).local_experts(3) for r in range(4)] == [[0], [1], [2], []]
    emap = MoEPlan.decide(layout, 1).expert_map(10)
    assert emap.tolist() == [-1, -1, -1, 0, 1, 2, -1, -1, -1, -1]
    assert emap.dtype == torch.int64


def test_local_experts_without_ep_is_every_expert():
    plan = MoEPlan.decide(_layout(2, 1, 2, False), 3)
    assert plan.local_experts(5) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="placement"):
        plan.local_experts(5, "random")
