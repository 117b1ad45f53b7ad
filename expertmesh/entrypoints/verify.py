"""`expertmesh verify`: every layout that fits the model and the world, checked against one process.

For a model and a world of N ranks (torchrun's, or N self-spawned workers with `--world N`),
runs every (DP, PP, TP, EP, all2all backend) layout with DP x PP x TP = N that the model's sizes
allow, each rank generating greedily for its DP replica's share of the prompts (uneven: the
last replica gets fewer), and compares every rank's tokens with one process. Prints a table
(layout, backend, ranks agreeing, the first differing token where one differs, bytes the MoE
exchange moved, tok/s) and exits 1 on any disagreement; `--json` prints the rows for scripts.
Every engine, the one-process reference included, runs with ``deterministic=True`` (layout-
invariant sums, distributed/fixed_sum.py; not with ``--no-deterministic``, nor on a quantized
checkpoint, which that mode does not serve yet), and every generated token's logprob must then
equal one process's bit for bit too, bf16 included; the table's "logprobs" column says "bitwise"
or the largest difference.
`--eplb` adds, for every EP layout with more than one EP rank, the same layout with EPLB: two
redundant experts and an online rebalance every two forwards, so expert weights move between
ranks during the run and the tokens must still equal one process.

    expertmesh verify --world 4 --model <dir>
    torchrun --nproc-per-node=4 -m expertmesh.entrypoints.cli verify --model <dir>
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from expertmesh.config import ModelConfig
from expertmesh.config.hf_config import load_hf_config
from expertmesh.config.model_source import resolve_model
from expertmesh.distributed.launcher import torchrun_env
from expertmesh.entrypoints.llm import LLM
from expertmesh.executor.spawn import run_spmd
from expertmesh.logger import setup_logging
from expertmesh.sampling_params import SamplingParams

BACKENDS_WITH_DP = ("naive", "allgather_reducescatter")
EPLB_REDUNDANT = 2


@dataclass(frozen=True)
class Case:
    dp: int
    pp: int
    tp: int
    ep: bool
    backend: str
    eplb: bool = False

    @property
    def label(self) -> str:
        return (
            f"DP{self.dp} PP{self.pp} TP{self.tp}"
            + (" EP" if self.ep else "")
            + (" EPLB" if self.eplb else "")
        )

    def eplb_kwargs(self) -> dict:
        """LLM keywords of the EPLB variant: two redundant experts, a rebalance every 2 forwards."""
        if not self.eplb:
            return {}
        return dict(
            enable_eplb=True, eplb_config={"num_redundant_experts": EPLB_REDUNDANT, "step_interval": 2}
        )


def factorizations(world: int) -> list[tuple[int, int, int]]:
    """(DP, PP, TP) with DP x PP x TP = world, DP-major."""
    return [
        (dp, pp, world // (dp * pp))
        for dp in range(world, 0, -1)
        if world % dp == 0
        for pp in range(world // dp, 0, -1)
        if (world // dp) % pp == 0
    ]


def does_not_fit(case: Case, mc: ModelConfig) -> str | None:
    """Why the model's sizes rule this layout out (the engine would refuse it too), or None."""
    tp, shards = case.tp, case.dp * case.tp
    if mc.num_heads % tp:
        return f"{mc.num_heads} attention heads over TP {tp}"
    if mc.num_kv_heads % tp and tp % mc.num_kv_heads:
        return f"{mc.num_kv_heads} KV heads over TP {tp}"
    if mc.vocab_size % tp:
        return f"vocab {mc.vocab_size} over TP {tp}"
    if mc.num_layers < case.pp:
        return f"{mc.num_layers} layers over PP {case.pp}"
    if mc.intermediate_size and any(not mc.is_moe_layer(i) for i in range(mc.num_layers)):
        if mc.intermediate_size % tp:
            return f"dense intermediate {mc.intermediate_size} over TP {tp}"
    if mc.is_moe and not case.ep and mc.moe_intermediate_size % (shards if case.dp > 1 else tp):
        return f"expert intermediate {mc.moe_intermediate_size} over {shards if case.dp > 1 else tp} shards"
    if mc.is_moe and case.ep and mc.num_experts < (shards if case.dp > 1 else tp):
        return f"{mc.num_experts} experts over EP {shards if case.dp > 1 else tp}"
    if mc.shared_expert_intermediate_size % tp:
        return f"shared expert {mc.shared_expert_intermediate_size} over TP {tp}"
    if case.eplb and shards < 2:
        return "EPLB over a single EP rank"
    return None


def cases_for(world: int, mc: ModelConfig, eplb: bool = False) -> tuple[list[Case], list[tuple[Case, str]]]:
    """(layouts to run, layouts left out with the reason); `eplb`: each EP layout also with EPLB."""
    run, skipped = [], []
    for dp, pp, tp in factorizations(world):
        for ep in (False, True) if mc.is_moe else (False,):
            names = (BACKENDS_WITH_DP + (("alltoall",) if ep else ())) if dp > 1 else BACKENDS_WITH_DP[1:]
            for backend in names:
                for balanced in (False, True) if ep and eplb else (False,):
                    case = Case(dp, pp, tp, ep, backend, balanced)
                    reason = does_not_fit(case, mc)
                    (skipped.append((case, reason)) if reason else run.append(case))
    return run, skipped


def prompt_share(num_prompts: int, dp: int, dp_rank: int) -> list[int]:
    """Prompt indices of one DP replica: round robin, so with more replicas than prompts some
    replicas get none, and otherwise the last ones get fewer."""
    return list(range(dp_rank, num_prompts, dp))


def _engine_kwargs(spec: dict) -> dict:
    keys = ("max_model_len", "kv_cache_memory_bytes", "dtype", "deterministic")
    return {k: spec[k] for k in keys if spec.get(k)}


def _params(spec: dict):
    return SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=1)


def _chosen_logprobs(out) -> list[float]:
    """The logprob of each generated token (greedy: the top one)."""
    c = out.outputs[0]
    return [pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs or [], strict=False)]


def shown_backend(case: Case) -> str:
    """The backend only moves tokens between DP ranks: with DP=1 there is nothing to show."""
    return case.backend if case.dp > 1 else "- (no exchange)"


def reference_tokens(spec: dict) -> tuple[list[list[int]], list[list[float]]]:
    """One process's tokens and their logprobs."""
    setup_logging().setLevel(logging.WARNING)

    llm = LLM(spec["model"], **_engine_kwargs(spec))
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], _params(spec), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [_chosen_logprobs(o) for o in outs]


def run_cases(rank: int, world: int, spec: dict, cases: list[Case], setup: Callable | None = None):
    """SPMD, on every rank: each case's (prompt indices, tokens, bytes sent, seconds, logprobs)."""
    setup_logging(rank).setLevel(logging.WARNING)  # one progress line per layout instead
    if setup is not None:
        setup()
    params = _params(spec)
    results = []
    for n, case in enumerate(cases, 1):
        if rank == 0:
            print(
                f"[verify] {n}/{len(cases)} {case.label} {shown_backend(case)}", file=sys.stderr, flush=True
            )
        llm = LLM(
            spec["model"],
            data_parallel_size=case.dp,
            pipeline_parallel_size=case.pp,
            tensor_parallel_size=case.tp,
            enable_expert_parallel=case.ep,
            all2all_backend=case.backend,
            distributed_executor_backend="external_launcher",
            **case.eplb_kwargs(),
            **_engine_kwargs(spec),
        )
        dp_rank = llm.llm_engine.vllm_config.parallel_config.data_parallel_rank
        idx = prompt_share(len(spec["prompts"]), case.dp, dp_rank)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": spec["prompts"][i]} for i in idx], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        sent = llm.all2all_stats()["bytes_sent"]
        lps = [_chosen_logprobs(o) for o in outs]
        results.append((idx, [o.outputs[0].token_ids for o in outs], sent, seconds, lps))
        del llm
    return results


def first_difference(ours: list[int], ref: list[int]) -> int | None:
    for j, (a, b) in enumerate(zip(ours, ref, strict=False)):  # lengths may differ: reported below
        if a != b:
            return j
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


def logprob_difference(idx, tokens, lps, expected, expected_lps) -> float:
    """Largest |logprob difference| over the positions whose tokens equal one process's."""
    worst = 0.0
    for i, t, lp in zip(idx, tokens, lps, strict=True):
        for j, (a, b) in enumerate(zip(lp, expected_lps[i], strict=False)):
            if j < len(t) and j < len(expected[i]) and t[j] == expected[i][j]:
                worst = max(worst, abs(a - b))
    return worst


def compare(
    cases: list[Case],
    per_rank: list[list[tuple]],
    expected: list[list[int]],
    expected_lps: list[list[float]] | None = None,
    bitwise: bool = False,
) -> list[dict]:
    """Rows of the table. `bitwise`: a rank agrees only if its logprobs equal one process's too."""
    rows = []
    for c, case in enumerate(cases):
        agree, first, lp_diff = 0, None, 0.0
        for rank, results in enumerate(per_rank):
            idx, tokens = results[c][0], results[c][1]
            bad = [
                (i, first_difference(t, expected[i]))
                for i, t in zip(idx, tokens, strict=True)
                if t != expected[i]
            ]
            diff = 0.0
            if expected_lps is not None and len(results[c]) > 4:
                diff = logprob_difference(idx, tokens, results[c][4], expected, expected_lps)
            lp_diff = max(lp_diff, diff)
            agree += not bad and not (bitwise and diff)
            if bad and first is None:
                i, j = bad[0]
                got = per_rank[rank][c][1][idx.index(i)]
                first = {
                    "rank": rank,
                    "prompt": i,
                    "token": j,
                    "got": got[j : j + 1],
                    "want": expected[i][j : j + 1],
                }
        # Tokens per replica are counted once (by each replica's ranks alike): world / dp ranks share them.
        generated = sum(len(t) for r in per_rank for t in r[c][1]) * case.dp / len(per_rank)
        seconds = max(r[c][3] for r in per_rank)
        rows.append(
            {
                **asdict(case),
                "layout": case.label,
                "shown_backend": shown_backend(case),
                "ranks_agreeing": agree,
                "ranks": len(per_rank),
                "first_difference": first,
                "max_logprob_difference": lp_diff,
                "logprobs_bitwise": lp_diff == 0.0,
                "bytes_sent": sum(r[c][2] for r in per_rank),
                "tok_s": round(generated / seconds, 1) if seconds > 0 else None,
            }
        )
    return rows


COLUMNS = (
    ("layout", 20), ("backend", 24), ("ranks agreeing", 15), ("first difference", 40), ("logprobs", 10),
)  # fmt: skip


def table(rows: list[dict], skipped: list[tuple[Case, str]]) -> str:
    def line(cells: list[str], tail: str) -> str:
        # a case not run has fewer cells than columns (its reason goes in the tail)
        return " ".join(f"{c:<{w}}" for c, (_, w) in zip(cells, COLUMNS, strict=False)) + tail

    lines = [line([name for name, _ in COLUMNS], f"{'a2a bytes':>12} {'tok/s':>8}")]
    for r in rows:
        d, diff = r["first_difference"], "-"
        if d:
            diff = f"rank {d['rank']} prompt {d['prompt']} token {d['token']}: {d['got']} != {d['want']}"
        agree = f"{r['ranks_agreeing']}/{r['ranks']}"
        lp = "bitwise" if r.get("logprobs_bitwise", True) else f"{r.get('max_logprob_difference', 0):.2g}"
        lines.append(
            line([r["layout"], r["shown_backend"], agree, diff, lp], f"{r['bytes_sent']:>12} {r['tok_s']:>8}")
        )
    for case, reason in skipped:
        lines.append(line([case.label, shown_backend(case)], f"not run: {reason}"))
    return "\n".join(lines)


def default_prompts(vocab: int, count: int = 6, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of uneven lengths (1 to 29 tokens) avoiding the usual special ids 0-2."""
    rng = random.Random(seed)
    lengths = [1, 29, 7, 14, 3, 21, 9, 5][:count]
    return [[rng.randrange(min(3, vocab - 1), vocab) for _ in range(n)] for n in lengths]


def verify(
    model: str | None,
    world: int,
    max_tokens: int = 8,
    max_model_len: int = 128,
    kv_cache_memory_bytes: int = 1 << 23,
    dtype: str = "auto",
    setup: Callable | None = None,
    timeout: float = 900.0,
    eplb: bool = False,
    deterministic: bool = True,
) -> tuple[list[dict], list[tuple[Case, str]]]:
    """Self-spawned world of `world` ranks; `setup` (importable) runs first in every rank, which
    is how tests break a layout on purpose."""
    model_dir = resolve_model(model, None)
    mc = ModelConfig.from_hf(load_hf_config(model_dir), dtype)
    spec = {
        "model": model_dir, "prompts": default_prompts(mc.vocab_size), "max_tokens": max_tokens,
        "max_model_len": max_model_len, "kv_cache_memory_bytes": kv_cache_memory_bytes, "dtype": dtype,
        "deterministic": deterministic,
    }  # fmt: skip
    spec["deterministic"] = deterministic and mc.quantization is None  # quantized: not served yet
    cases, skipped = cases_for(world, mc, eplb)
    expected, expected_lps = reference_tokens(spec)
    per_rank = run_spmd(run_cases, world, spec, cases, setup, timeout=timeout) if cases else []
    return compare(cases, per_rank, expected, expected_lps, bitwise=spec["deterministic"]), skipped


def verify_under_torchrun(model: str | None, **kw: Any) -> tuple[list[dict], list[tuple[Case, str]]] | None:
    """Every rank of torchrun's world runs the layouts; rank 0 gets the rows (others None)."""
    eplb = kw.pop("eplb", False)
    kw.setdefault("deterministic", True)
    env = torchrun_env()
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world)
    model_dir = resolve_model(model, None)
    mc = ModelConfig.from_hf(load_hf_config(model_dir), kw.get("dtype", "auto"))
    spec = {"model": model_dir, "prompts": default_prompts(mc.vocab_size), **kw}
    spec["deterministic"] = spec["deterministic"] and mc.quantization is None
    cases, skipped = cases_for(world, mc, eplb)
    results = run_cases(rank, world, spec, cases)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(results, gathered, dst=0)
    # Every rank ends its process groups now, while all are alive: a rank leaving with gloo's
    # threads still up (rank 0 goes on to compute the reference alone) was now and then aborted
    # in the interpreter's teardown ("terminate called without an active exception").
    dist.destroy_process_group()
    if rank != 0:
        return None
    expected, expected_lps = reference_tokens(spec)
    return compare(cases, gathered, expected, expected_lps, bitwise=spec["deterministic"]), skipped


def report(rows: list[dict], skipped: list[tuple[Case, str]], as_json: bool) -> int:
    bad = [r for r in rows if r["ranks_agreeing"] != r["ranks"]]
    if as_json:
        out = {"ok": not bad, "rows": rows, "not_run": [{**asdict(c), "reason": why} for c, why in skipped]}
        print(json.dumps(out, indent=2))
    else:
        print(table(rows, skipped))
        same = "every rank of every layout equals one process"
        if rows and all(r.get("logprobs_bitwise") for r in rows):
            same += " (tokens, and logprobs bit for bit)"
        verdict = same if not bad else f"{len(bad)} layout(s) disagree"
        print(f"\n{len(rows)} layouts run, {len(skipped)} not run: {verdict}")
    sys.stdout.flush()
    return 1 if bad or not rows else 0
