import itertools

import pytest

from expertmesh.distributed.layout import ParallelLayout, check_world_size

# (DP, PP, TP) -> expected groups, written out by hand from rank = (dp * PP + pp) * TP + tp.
EXPECTED = {
    (2, 1, 2): {
        "tp": [(0, 1), (2, 3)],
        "pp": [(0,), (1,), (2,), (3,)],
        "dp": [(0, 2), (1, 3)],
        "ep": [(0, 1, 2, 3)],
        "world": [(0, 1, 2, 3)],
    },
    (2, 2, 2): {
        "tp": [(0, 1), (2, 3), (4, 5), (6, 7)],
        "pp": [(0, 2), (1, 3), (4, 6), (5, 7)],
        "dp": [(0, 4), (1, 5), (2, 6), (3, 7)],
        "ep": [(0, 1, 4, 5), (2, 3, 6, 7)],
        "world": [tuple(range(8))],
    },
    (4, 1, 1): {
        "tp": [(0,), (1,), (2,), (3,)],
        "pp": [(0,), (1,), (2,), (3,)],
        "dp": [(0, 1, 2, 3)],
        "ep": [(0, 1, 2, 3)],
        "world": [(0, 1, 2, 3)],
    },
    (1, 2, 2): {
        "tp": [(0, 1), (2, 3)],
        "pp": [(0, 2), (1, 3)],
        "dp": [(0,), (1,), (2,), (3,)],
        "ep": [(0, 1), (2, 3)],
        "world": [(0, 1, 2, 3)],
    },
}


def _layout(dp: int, pp: int, tp: int, ep: bool = False) -> ParallelLayout:
    return ParallelLayout(
        data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp, enable_expert_parallel=ep
    )


@pytest.mark.parametrize("sizes", list(EXPECTED))
@pytest.mark.parametrize("ep", [False, True])
def test_group_membership(sizes, ep):
    layout = _layout(*sizes, ep=ep)
    assert layout.tp_group_ranks() == EXPECTED[sizes]["tp"]
    assert layout.pp_group_ranks() == EXPECTED[sizes]["pp"]
    assert layout.dp_group_ranks() == EXPECTED[sizes]["dp"]
    assert layout.ep_group_ranks() == EXPECTED[sizes]["ep"]
    assert layout.world_ranks == EXPECTED[sizes]["world"]
    for kind, groups in EXPECTED[sizes].items():
        assert layout.group_ranks(kind) == groups
        for group in groups:
            for rank in group:
                assert layout.group_of(kind, rank) == group


def test_rank_mapping():
    layout = _layout(2, 2, 2)
    assert layout.coords(5) == (1, 0, 1)
    assert layout.coords(6) == (1, 1, 0)
    assert layout.rank_of(0, 1, 1) == 3
    for dp, pp, tp in itertools.product(range(3), range(2), range(4)):
        big = _layout(3, 2, 4)
        rank = (dp * 2 + pp) * 4 + tp
        assert big.rank_of(dp, pp, tp) == rank
        assert big.coords(rank) == (dp, pp, tp)


@pytest.mark.parametrize("sizes", [(1, 1, 1), (3, 1, 2), (2, 3, 1), (2, 2, 3)])
def test_groups_partition_world_and_agree_with_coords(sizes):
    layout = _layout(*sizes)
    for kind in ("tp", "pp", "dp", "ep", "world"):
        flat = sorted(r for g in layout.group_ranks(kind) for r in g)
        assert flat == list(range(layout.world_size)), kind
    for rank in range(layout.world_size):
        dp, pp, tp = layout.coords(rank)
        assert all(layout.coords(r)[:2] == (dp, pp) for r in layout.group_of("tp", rank))
        assert all(layout.coords(r)[1] == pp for r in layout.group_of("ep", rank))
        # EP index is dp-major: dp * TP + tp.
        assert layout.group_of("ep", rank).index(rank) == dp * layout.tp + tp
        assert layout.group_of("dp", rank).index(rank) == dp


def test_validation_names_field_and_value():
    with pytest.raises(ValueError, match=r"tensor_parallel_size.*0"):
        _layout(1, 1, 0)
    with pytest.raises(ValueError, match=r"data_parallel_size.*2\.0"):
        ParallelLayout(data_parallel_size=2.0)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        ParallelLayout(pipeline_parallel_size=True)
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        ParallelLayout(enable_expert_parallel=1)
    with pytest.raises(ValueError, match="rank 4"):
        _layout(2, 1, 2).coords(4)
    with pytest.raises(ValueError, match="tp=2"):
        _layout(2, 1, 2).rank_of(0, 0, 2)
    with pytest.raises(ValueError, match="unknown group kind"):
        _layout(2, 1, 2).group_of("xp", 0)


def test_check_world_size():
    check_world_size(_layout(2, 1, 2), 4)
    with pytest.raises(ValueError) as err:
        check_world_size(_layout(2, 3, 2), 6)
    for text in ("WORLD_SIZE=6", "DP=2", "PP=3", "TP=2", "= 12"):
        assert text in str(err.value)


def test_default_device_one_gpu_a_rank(monkeypatch):
    """A process takes cuda:LOCAL_RANK when it sees GPUs, the CPU when it sees none; a local rank
    with no GPU of its own is an error naming the rank and the count, not a crash in NCCL."""
    import torch

    from expertmesh.distributed.launcher import default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device(0) == "cpu" and default_device(3) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert default_device(0) == "cuda:0"
    with pytest.raises(ValueError, match=r"local rank 1 needs its own CUDA device but this node sees 1"):
        default_device(1)
