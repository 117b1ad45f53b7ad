"""A roofline for the benchmark workloads: what this machine could do at best, from two measurements.

- matmul FLOP/s at the model's own shapes (decode: 32 rows; prefill: 512 rows), best of several runs;
- memory read bandwidth: sum() over a 256 MiB tensor, far larger than the caches, best of several runs.

A workload (requests submitted at once: prompt length, new tokens) is replayed step by step as an
ideal engine would run it: one prefill of all prompts, then one decode step per generated token
with every unfinished request in the batch. Each step costs max(bytes / bandwidth, FLOPs / FLOP/s),
the bytes being the weights the step touches (attention, router, the experts its tokens pick,
lm_head, the embedding rows) plus the KV cache it reads. Routing is assumed uniform (a random
model's router is close to it): n tokens picking k of E experts touch E * (1 - (1 - k/E)^n) experts.

    .venv/bin/python benchmarks/roofline.py --model /tmp/expertmesh-bench/small-moe-fp32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

BYTES = {"float32": 4, "bfloat16": 2}
DECODE_ROWS, PREFILL_ROWS = 32, 512
BANDWIDTH_MIB = 256


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    inter: int
    layers: int
    experts: int
    top_k: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_model_dir(cls, path: str) -> MoEShape:
        c = json.loads((Path(path) / "config.json").read_text())
        return cls(
            c["hidden_size"],
            c.get("moe_intermediate_size") or c["intermediate_size"],  # Qwen-MoE or Mixtral
            c["num_hidden_layers"],
            c.get("num_local_experts") or c["num_experts"],
            c["num_experts_per_tok"],
            c["num_attention_heads"],
            c["num_key_value_heads"],
            c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            c["vocab_size"],
        )

    @property
    def attn_params(self) -> int:
        """q, k, v and o projections of one layer."""
        h, d = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.inter

    def matmul_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of every distinct matmul in a step: qkv, o, expert gate+up, expert down, lm_head."""
        h, d = self.hidden, self.head_dim
        qkv = (self.heads + 2 * self.kv_heads) * d
        return [(h, qkv), (self.heads * d, h), (h, 2 * self.inter), (self.inter, h), (h, self.vocab)]


@dataclass(frozen=True)
class Machine:
    bandwidth: float  # bytes/s read from memory
    decode_flops: float  # FLOP/s, best of the model's matmuls at DECODE_ROWS rows
    prefill_flops: float  # FLOP/s at PREFILL_ROWS rows


def _best_time(fn: Callable[[], object], rounds: int = 10, min_s: float = 0.02) -> float:
    """Best per-call seconds over `rounds` rounds, each at least `min_s` long (noise only adds time)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_s:
                break
        best = min(best, elapsed / calls)
    return best


def matmul_flops(rows: int, k: int, n: int, dtype: torch.dtype) -> float:
    """torch's matmul rate. For bf16 the better of bf16 and float32: where oneDNN has no bf16
    path (AVX2-only CPUs) torch's bf16 matmul is a slow fallback, and an engine can always widen
    bf16 to float32 in registers, as ours does there, at float32's rate."""
    x, w = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype)
    with torch.inference_mode():
        rate = 2 * rows * k * n / _best_time(lambda: torch.nn.functional.linear(x, w))
    return max(rate, matmul_flops(rows, k, n, torch.float32)) if dtype == torch.bfloat16 else rate


def read_bandwidth(mib: int = BANDWIDTH_MIB) -> float:
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    return x.numel() * 4 / _best_time(x.sum, rounds=10, min_s=0.1)


def measure(shape: MoEShape, dtype: str, threads: int) -> tuple[Machine, dict[str, float]]:
    """This machine's bandwidth and FLOP/s for `dtype`, and every single measurement (for the report)."""
    torch.set_num_threads(threads)
    td = getattr(torch, dtype)
    detail = {"read_GBps": read_bandwidth() / 1e9}
    decode = 0.0
    for k, n in shape.matmul_shapes():
        rate = matmul_flops(DECODE_ROWS, k, n, td)
        detail[f"{dtype} [{DECODE_ROWS},{k}]x[{k},{n}] GFLOPs"] = rate / 1e9
        decode = max(decode, rate)
    h, i2 = shape.hidden, 2 * shape.inter
    prefill = matmul_flops(PREFILL_ROWS, h, i2, td)
    detail[f"{dtype} [{PREFILL_ROWS},{h}]x[{h},{i2}] GFLOPs"] = prefill / 1e9
    return Machine(detail["read_GBps"] * 1e9, decode, prefill), detail


def experts_touched(shape: MoEShape, tokens: int) -> float:
    """Expected distinct experts per layer for `tokens` tokens under uniform routing."""
    return shape.experts * (1 - (1 - shape.top_k / shape.experts) ** tokens)


def step_cost(
    shape: MoEShape, tokens: int, kv_reads: int, attn_pairs: int, nbytes: int
) -> tuple[float, float]:
    """(bytes, FLOPs) of one forward over `tokens` tokens that read `kv_reads` cached positions
    in all and form `attn_pairs` (query, key) pairs, both summed over the batch."""
    per_layer = shape.attn_params + shape.hidden * shape.experts + 2 * shape.hidden  # + router, norms
    per_layer += experts_touched(shape, tokens) * shape.expert_params
    kv_width = 2 * shape.kv_heads * shape.head_dim  # K and V of one position in one layer
    weights = shape.layers * per_layer + shape.vocab * shape.hidden + min(tokens, shape.vocab) * shape.hidden
    bytes_ = (weights + shape.layers * kv_reads * kv_width) * nbytes
    routed = shape.top_k * shape.expert_params
    dense = shape.layers * (shape.attn_params + shape.hidden * shape.experts + routed)
    # lm_head on every row here; the prefill takes back its non-last rows.
    flops = 2 * tokens * dense + 2 * tokens * shape.vocab * shape.hidden
    flops += shape.layers * 4 * shape.heads * shape.head_dim * attn_pairs  # QK^T and PV
    return bytes_, flops


def workload_bound(shape: MoEShape, requests: list[tuple[int, int]], machine: Machine, dtype: str) -> float:
    """Lower bound on seconds for (prompt length, new tokens) requests submitted at once."""
    nbytes = BYTES[dtype]
    prompt_tokens = sum(p for p, _ in requests)
    b, f = step_cost(shape, prompt_tokens, 0, sum(p * (p + 1) // 2 for p, _ in requests), nbytes)
    # Prefill counts the lm_head for last positions only: subtract the rest.
    f -= 2 * (prompt_tokens - len(requests)) * shape.vocab * shape.hidden
    seconds = max(b / machine.bandwidth, f / machine.prefill_flops)
    for t in range(1, max(o for _, o in requests)):  # the prefill already produced token 1
        live = [p + t for p, o in requests if o > t]  # context length of each running request
        b, f = step_cost(shape, len(live), sum(live), sum(live), nbytes)
        seconds += max(b / machine.bandwidth, f / machine.decode_flops)
    return seconds


def bound_tokens_per_s(
    shape: MoEShape, requests: list[tuple[int, int]], machine: Machine, dtype: str, count_prompt: bool = False
) -> float:
    """Output tokens (prompt tokens with `count_prompt`: the prefill workload) per bound second."""
    tokens = sum(p if count_prompt else o for p, o in requests)
    return tokens / workload_bound(shape, requests, machine, dtype)


def decode_step_summary(shape: MoEShape, dtype: str) -> dict[str, float]:
    """The brief's two headline numbers: MB read per decode step at batch 1, GFLOP per step at batch 32."""
    b1, _ = step_cost(shape, 1, 0, 0, BYTES[dtype])
    _, f32 = step_cost(shape, 32, 0, 0, BYTES[dtype])
    return {"weight_MB_per_step_b1": b1 / 1e6, "GFLOP_per_step_b32": f32 / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description="Measure this machine's roofline for the small MoE.")
    ap.add_argument("--model", required=True, help="a checkpoint directory (its config.json is read)")
    ap.add_argument("--dtype", default="float32", choices=sorted(BYTES))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    shape = MoEShape.from_model_dir(args.model)
    machine, detail = measure(shape, args.dtype, args.threads)
    for key, value in {**detail, **decode_step_summary(shape, args.dtype)}.items():
        print(f"{key:45s} {value:10.2f}")
    for batch in (1, 8, 32):
        tps = bound_tokens_per_s(shape, [(16, 64)] * batch, machine, args.dtype)
        print(f"bound, batch {batch:3d}, prompt 16, 64 new tokens: {tps:10.0f} tok/s")


if __name__ == "__main__":
    main()
