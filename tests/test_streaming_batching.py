"""A streaming reader that falls behind gets the queued steps as one update (async_engine.coalesce):
the same tokens, logprobs and text as one update a step, in fewer updates."""

from __future__ import annotations

import asyncio

from expertmesh import LLM, SamplingParams
from expertmesh.entrypoints.async_engine import AsyncEngine, SeqDelta, Update, coalesce

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, n=2, seed=1)


def test_coalesce_joins_each_sequence_in_order():
    a = Update([SeqDelta(0, [1], [{1: "a"}], "x"), SeqDelta(1, [5], None, "p")])
    b = Update([SeqDelta(1, [6], None, "q"), SeqDelta(0, [2, 3], [{2: "b"}, {3: "c"}], "yz")], final=None)
    got = coalesce(a, b)
    assert got.deltas == [
        SeqDelta(0, [1, 2, 3], [{1: "a"}, {2: "b"}, {3: "c"}], "xyz"),
        SeqDelta(1, [5, 6], None, "pq"),
    ]
    assert a.deltas[0] == SeqDelta(0, [1], [{1: "a"}], "x")  # the inputs are left as they were


def _joined(updates: list[Update]) -> list[tuple]:
    out = []
    for i in range(PARAMS.n):
        ds = [d for u in updates for d in u.deltas if d.index == i]
        lps = [sorted(x) for d in ds for x in (d.logprobs or [])]
        out.append(([t for d in ds for t in d.token_ids], lps, "".join(d.text for d in ds)))
    return out


async def _collect(engine: AsyncEngine, lag: bool) -> list[Update]:
    updates = []
    gen = engine.generate("The cat sat on", PARAMS, stream=True)
    updates.append(await gen.__anext__())
    while lag and engine._active:  # fall behind until the engine has finished the request
        await asyncio.sleep(0.01)
    async for u in gen:
        updates.append(u)
    return updates


def test_a_reader_that_falls_behind_gets_one_update_with_everything(checkpoint):
    llm = LLM(checkpoint("mixtral"), max_model_len=128, kv_cache_memory_bytes=1 << 22, warmup=False)
    engine = AsyncEngine(llm)
    try:
        step_by_step = asyncio.run(_collect(engine, lag=False))
        behind = asyncio.run(_collect(engine, lag=True))
    finally:
        engine.shutdown()
    assert len(behind) == 2 and behind[-1].final is not None  # the first update, then all the rest
    assert len(step_by_step) > 2
    assert _joined(behind) == _joined(step_by_step)
    final = behind[-1].final.outputs
    assert [(c.token_ids, c.text) for c in final] == [(t, s) for t, _, s in _joined(behind)]
