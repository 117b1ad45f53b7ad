"""Speculative decoding on a hybrid slice (Gated DeltaNet / Mamba2 layers, benchmarks/hybrid_slice.py):
what a verify step costs when the recurrent state is kept per draft position and rolled back.

A random slice does not copy its context, so n-gram drafts would all be rejected; the drafts here
come from a proposer that knows the greedy output (the engine's own, computed first) and drafts it
(a) right throughout, (b) with one token made wrong at a position cycling through 0..k (mean
acceptance about k / 2), (c) wrong at its first token (the cost of a rejected draft), against (d) no
drafting, all on one engine (its proposer swapped between runs), interleaved round by round, batch
1, greedy. Every run's tokens are checked equal to the plain ones. Read the ratios: the machine is
shared.

    .venv/bin/python benchmarks/bench_spec_hybrid.py --family qwen3.5 --quick      # ~3 min
    .venv/bin/python benchmarks/bench_spec_hybrid.py --family nemotron-h --rounds 5 --new 48
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from hybrid_slice import SLICES, make_model  # noqa: E402

from expertmesh import LLM, SamplingParams  # noqa: E402


class Known:
    """Drafts of the known greedy continuation `out` of `prompt`: `wrong` is None (all right), an
    index cycling 0..k ("cycle"), or 0 (first token wrong)."""

    def __init__(self, prompt: list[int], out: list[int], k: int, mode: str) -> None:
        self.prompt, self.out, self.k, self.mode, self.calls = prompt, out, k, mode, 0

    def propose(self, tokens, limit: int) -> list[int]:
        done = len(tokens) - len(self.prompt)
        draft = self.out[done : done + min(self.k, limit)]
        if self.mode == "none":
            return []
        wrong = {"right": None, "cycle": self.calls % (self.k + 1), "wrong": 0}[self.mode]
        self.calls += 1
        if wrong is not None and wrong < len(draft):
            draft[wrong] = (draft[wrong] + 1) % 512
        return draft


def run(llm: LLM, prompt: list[int], new: int, out: list[int] | None, k: int, mode: str):
    drafter = llm.llm_engine.drafter
    drafter.proposer, drafter.gate = Known(prompt, out or [], k, mode), None
    before = dict(llm.llm_engine.stats())
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    got = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids
    seconds = time.perf_counter() - t0
    after = llm.llm_engine.stats()
    acc = after["spec_decode_num_accepted_tokens"] - before.get("spec_decode_num_accepted_tokens", 0)
    drafted = after["spec_decode_num_draft_tokens"] - before.get("spec_decode_num_draft_tokens", 0)
    return list(got), new / seconds, acc, drafted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(SLICES), default="qwen3.5")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 16 tokens")
    ap.add_argument("--cache", default="/tmp/expertmesh-bench")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.new = 2, 16
    path = make_model(SLICES[a.family], a.cache)
    spec = {"method": "ngram", "num_speculative_tokens": a.k, "disable_by_batch_size": 64}
    llm = LLM(path, dtype="bfloat16", max_model_len=a.prompt + a.new + 16, max_num_seqs=4,
              enable_prefix_caching=False, speculative_config=spec)  # fmt: skip
    prompt = torch.randint(3, 512, (a.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    plain, _, _, _ = run(llm, prompt, a.new, None, a.k, "none")  # also the warm-up
    modes = ["none", "right", "cycle", "wrong"]
    speed = {m: [] for m in modes}
    counts = {m: [0, 0] for m in modes}
    for _ in range(a.rounds):
        for m in modes:  # interleaved: the same load on every mode
            got, tps, acc, drafted = run(llm, prompt, a.new, plain, a.k, m)
            assert got == plain, f"{m}: tokens differ from decoding without drafts"
            speed[m].append(tps)
            counts[m][0] += acc
            counts[m][1] += drafted
    cpu = platform.processor() or platform.machine()
    print(f"{a.family} slice, bf16, batch 1, k={a.k}, {a.prompt}-token prompt, {a.new} new tokens, "
          f"{a.rounds} rounds, torch threads {torch.get_num_threads()}, {cpu}, "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    base = speed["none"]
    print("| drafts | tok/s (median) | vs no drafts (median of rounds) | accepted / drafted |")
    print("|---|---|---|---|")
    for m in modes:
        ratio = statistics.median(s / b for s, b in zip(speed[m], base, strict=True))
        print(f"| {m} | {statistics.median(speed[m]):.2f} | {ratio:.2f}x | {counts[m][0]}/{counts[m][1]} |")


if __name__ == "__main__":
    main()
