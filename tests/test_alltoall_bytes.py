"""Exact bytes of the alltoall backend at EP 4 (top-2 of 8 experts), against allgather_reducescatter.

The expected numbers are worked out here from the routing alone: a token costs one row per
distinct REMOTE rank owning one of its experts (none for its own rank), plus the count exchange.
"""

import pytest
import torch
from distributed_utils import run_distributed

from expertmesh.distributed.all2all import make_all2all
from expertmesh.distributed.group import Group

EP, HIDDEN, TOPK, EXPERTS = 4, 16, 2, 8
OWNER = [0, 0, 1, 1, 2, 2, 3, 3]  # contiguous placement: two experts per rank
# Fixed routing per EP rank (rank 2 has no tokens); comments: owner ranks of the two experts.
ROUTING = [
    [[0, 1], [2, 7], [4, 5]],  # {0} (local only), {1, 3}, {2}
    [[3, 6]],  # {1, 3}
    [],
    [[6, 7], [0, 4]],  # {3} (local only), {0, 2}
]
SIZES = [len(r) for r in ROUTING]  # [3, 1, 0, 2]
X_ROW = HIDDEN * 4  # float32 hidden row
META_ROW = TOPK * 8 + TOPK * 4  # int64 ids + float32 weights travel with each row
COUNTS = (EP - 1) * 8  # one int64 count to each other rank


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = SIZES[rank]
    x = torch.arange(n * HIDDEN, dtype=torch.float32).reshape(n, HIDDEN) + 100 * rank  # [n, H]
    ids = torch.tensor(ROUTING[rank], dtype=torch.int64).reshape(n, TOPK)  # [n, k]
    return x, ids, torch.full((n, TOPK), 0.5)


def _remote_dests(rank: int) -> list[set[int]]:
    """Per token of ``rank``: the other ranks that must see it."""
    return [{OWNER[e] for e in ids} - {rank} for ids in ROUTING[rank]]


def _rank(rank: int, world_size: int) -> dict:
    group = Group(tuple(range(world_size)), rank, name="ep")
    x, ids, w = _batch(rank)
    out = {}
    for name in ("alltoall", "allgather_reducescatter"):
        a2a = make_all2all(name, group, poison_recv=True, expert_owner=torch.tensor(OWNER))
        x_recv, _, _ = a2a.dispatch(x, ids, w, SIZES)
        dispatched = a2a.reset_stats()
        # Identity "experts": every rank returns each row it got, once.
        y = a2a.combine(x_recv, SIZES)
        out[name] = (dispatched, a2a.reset_stats(), y, x_recv.shape[0])
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_rank, EP)


@pytest.mark.timeout(60)
def test_dispatch_bytes_exact(results):
    remote_rows = [sum(len(d) for d in _remote_dests(r)) for r in range(EP)]
    assert remote_rows == [3, 1, 0, 2]
    want_sent = [rows * (X_ROW + META_ROW) + COUNTS for rows in remote_rows]
    assert want_sent == [288, 112, 24, 200]  # e.g. rank 0: 3 rows x (64 + 24) bytes + 3 x 8
    # Rows each rank receives from the others: the tokens of other ranks that need it.
    want_in = [sum(r in d for s in range(EP) for d in _remote_dests(s)) for r in range(EP)]
    assert want_in == [1, 1, 2, 2]
    for rank in range(EP):
        dispatched, combined, _, _ = results[rank]["alltoall"]
        assert dispatched == {
            "bytes_sent": want_sent[rank],
            "bytes_received": want_in[rank] * (X_ROW + META_ROW) + COUNTS,
            "calls": 1,
        }
        # combine: each received row goes back once, hidden only.
        assert combined == {
            "bytes_sent": want_in[rank] * X_ROW,
            "bytes_received": remote_rows[rank] * X_ROW,
            "calls": 1,
        }


@pytest.mark.timeout(60)
def test_fewer_bytes_than_allgather_reducescatter(results):
    # all_gather_v pads to max(SIZES) rows and sends them to every other rank, x, ids and weights.
    agrs_dispatch = (EP - 1) * max(SIZES) * (X_ROW + META_ROW)
    assert agrs_dispatch == 792
    for rank in range(EP):
        a2a_d, a2a_c, _, _ = results[rank]["alltoall"]
        ag_d, ag_c, _, _ = results[rank]["allgather_reducescatter"]
        assert ag_d["bytes_sent"] == agrs_dispatch
        assert a2a_d["bytes_sent"] < ag_d["bytes_sent"]
        assert a2a_d["bytes_sent"] + a2a_c["bytes_sent"] < ag_d["bytes_sent"] + ag_c["bytes_sent"]


@pytest.mark.timeout(60)
def test_local_rows_stay_local_and_results_sum(results):
    for rank in range(EP):
        x, _, _ = _batch(rank)
        _, _, y, received = results[rank]["alltoall"]
        # Self rows go through the exchange but are not traffic: received counts them too.
        local = sum(rank in {OWNER[e] for e in ids} for ids in ROUTING[rank])
        remote = sum(rank in d for s in range(EP) for d in _remote_dests(s))
        assert received == local + remote
        # Identity experts: each token comes back once per distinct owner rank.
        copies = torch.tensor([float(len({OWNER[e] for e in ids})) for ids in ROUTING[rank]])
        torch.testing.assert_close(y, x * copies.reshape(-1, 1))
        _, _, y_ag, _ = results[rank]["allgather_reducescatter"]
        torch.testing.assert_close(y_ag, x * EP)  # every rank returns every row


def _engine_traffic(rank, world, path):
    from expertmesh import LLM, SamplingParams

    llm = LLM(
        path,
        data_parallel_size=2,
        enable_expert_parallel=True,
        all2all_backend="alltoall",
        distributed_executor_backend="external_launcher",
        max_model_len=64,
        kv_cache_memory_bytes=1 << 21,
    )
    llm.generate(
        [{"prompt_token_ids": [5, 6, 7, 8 + rank]}],
        SamplingParams(temperature=0, max_tokens=3),
        use_tqdm=False,
    )
    return llm.all2all_stats(per_layer=True)


@pytest.mark.timeout(60)
def test_engine_reports_traffic_per_layer_and_step(checkpoint):
    stats = run_distributed(_engine_traffic, 2, checkpoint("mixtral"), timeout=50)
    for s in stats:
        assert len(s["layers"]) == 2  # one backend per MoE layer
        assert s["bytes_sent"] == sum(layer["bytes_sent"] for layer in s["layers"]) > 0
        assert 0 < s["last_step"]["bytes_sent"] < s["bytes_sent"]
