"""The cost of one MTP draft step relative to one decode step, measured with the same engine.

Builds a random checkpoint of --family (DeepSeek-V3, LongCat-Flash or DeepSeek-V4: the published
config, shrunk to --layers / --hidden, with its MTP layer in the family's names), loads it with
speculative_config method="mtp", and interleaves, round by round:
- a decode step: batch-1 greedy generation of --max-tokens tokens minus that of 1 token (the prefill),
  per token, through the engine with speculation off (`Drafter` absent: a plain engine, same weights);
- a draft step (k=1) at each context length: the MTP layer over one new position with the earlier
  ones in its cache (spec_decode/mtp.py) and its head, on random hidden states of the right width.
The decode step at context n decodes --max-tokens tokens after a prompt of n - max_tokens tokens.
It prints the median ratios and the break-even acceptance (draft cost / decode cost: a verification
row is taken as free, batch-1 decode being weight-bandwidth bound) with the load average.

With --synthetic it also times batch-1 generation with and without MTP speculation (k = 1, 2) on a
copy of the checkpoint whose MTP layer is built to predict the target (tests/test_spec_mtp.py's
successor head, on output prefixes where the next token is a function of the current one): every
draft is accepted, so this is the speed-up at acceptance 1.0 on this shape.

    .venv/bin/python benchmarks/bench_spec_mtp.py --quick     # under a minute
    .venv/bin/python benchmarks/bench_spec_mtp.py --quick --synthetic
    .venv/bin/python benchmarks/bench_spec_mtp.py --layers 16 --hidden 512 --rounds 7
    .venv/bin/python benchmarks/bench_spec_mtp.py --quick --family longcat-flash   # or deepseek-v4
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


FAMILIES = ("deepseek-v3", "longcat-flash", "deepseek-v4")


def _checkpoint(root: str, layers: int, hidden: int, family: str = "deepseek-v3") -> str:
    """The family's published config shrunk to `layers` x `hidden`, with its MTP layer in the
    family's own names (tests/test_spec_mtp_2026.py writes LongCat's and V4's)."""
    from checkpoints import train_tokenizer
    from real_checkpoints import Sizes, build, published, shrink

    tok = os.path.join(root, "tok")
    train_tokenizer(tok)
    half = hidden // 2
    sizes = Sizes(
        layers=layers, hidden=hidden, heads=8, experts=16, max_top_k=4, expert_inter=half,
        dense_inter=2 * hidden, shared_inter=half, positions=4096, kv_lora_rank=hidden // 4,
        q_lora_rank=half, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    )  # fmt: skip
    if family == "deepseek-v3":
        return build(shrink(published("deepseek-v3"), sizes), os.path.join(root, "v3"), tok)
    from test_spec_mtp_2026 import with_longcat_mtp, with_v4_mtp

    if family == "longcat-flash":
        config = shrink(published("2026/longcat-flash-chat"), sizes, head_dim=sizes.qk_rope_head_dim)
        src = build(config, os.path.join(root, "longcat"), tok)
        return with_longcat_mtp(src, os.path.join(root, "longcat-mtp"))
    from test_deepseek_v4 import OVERRIDES

    src = build(
        shrink(published("2026/deepseek-v4-flash"), sizes, **OVERRIDES), os.path.join(root, "v4"), tok
    )
    return with_v4_mtp(src, os.path.join(root, "v4-mtp"))


def _decode_per_token(llm, prompt: list[int], n: int) -> float:
    from expertmesh import SamplingParams

    def run(m: int) -> float:
        p = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], p, use_tqdm=False)
        return time.perf_counter() - t

    return (run(n) - run(1)) / (n - 1)


def _draft(model, n: int, block_size: int, seq, repeats: int = 1) -> float:
    """One steady-state draft step (k=1) at context n: the MTP layer over the one new position, its
    n - 1 earlier positions cached (filled once per context, outside the timing), and its head; the
    median of `repeats` timings (a single sub-millisecond step is noise on a loaded machine)."""
    mtp, inner = model.mtp, model.model
    embed = mtp.embed_tokens if mtp.embed_tokens is not None else inner.embed_tokens  # LongCat: its own
    rotary = getattr(inner, "rotary", None)  # DeepSeek-V4's attention rotates by itself
    ids = torch.randint(0, model.cfg.vocab_size, (n,))
    hidden = torch.randn(n, mtp.row_width).to(model.cfg.dtype)  # V4: the hc streams, flattened
    cache = mtp.cache_for(seq, n, block_size, hidden.dtype)
    if getattr(seq, "filled", 0) < n:
        mtp(embed, rotary, ids, hidden, 0, cache, block_size)
        seq.filled = n
    times = []
    for _ in range(repeats):  # the same position again: it rewrites the same cache row
        t = time.perf_counter()
        h = mtp(embed, rotary, ids[-1:], hidden[-1:], n - 1, cache, block_size)
        int(mtp.logits(h[-1:]).argmax())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _synthetic(plain, path: str, root: str, rounds: int) -> str:
    """Batch-1 tok/s without and with MTP (k = 1, 2) whose drafts are all right, interleaved."""
    from checkpoints import prompts_of_lengths
    from test_spec_mtp import _consistent, _with_successor_head

    from expertmesh import LLM, SamplingParams

    candidates = prompts_of_lengths([4, 6, 8, 10, 12, 5, 7, 9, 11, 13, 3, 14], seed=5)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = plain.generate([{"prompt_token_ids": p} for p in candidates], sp, use_tqdm=False)
    chosen, successor = _consistent([list(o.outputs[0].token_ids) for o in outs], shortest=8)
    if not chosen:
        return "synthetic: no output prefix of 8+ tokens with one successor per token; nothing timed"
    synth = _with_successor_head(path, os.path.join(root, "synthetic"), successor)
    engine = dict(max_model_len=1024, kv_cache_memory_bytes=1 << 26, warmup=False)
    specs = {k: LLM(synth, **engine, speculative_config={"method": "mtp", "num_speculative_tokens": k})
             for k in (1, 2)}  # fmt: skip
    work = [
        (candidates[i], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        for i, n in chosen.items()
    ]
    tokens = sum(p.max_tokens for _, p in work)

    def timed(llm) -> float:
        t = time.perf_counter()
        for prompt, p in work:  # batch 1
            llm.generate([{"prompt_token_ids": prompt}], p, use_tqdm=False)
        return time.perf_counter() - t

    ratios: dict[int, list[float]] = {1: [], 2: []}
    base = []
    for _ in range(rounds):
        b = timed(plain)
        base.append(b)
        for k, llm in specs.items():
            ratios[k].append(b / timed(llm))
    lines = [f"synthetic MTP head (every draft right): {len(work)} prompts, {tokens} tokens, batch 1",
             f"plain: {tokens / statistics.median(base):.1f} tok/s"]  # fmt: skip
    for k, llm in specs.items():
        s = llm.llm_engine.stats()
        acc = f"{s['spec_decode_num_accepted_tokens']}/{s['spec_decode_num_draft_tokens']}"
        lines.append(
            f"mtp k={k}: {statistics.median(ratios[k]):.2f}x plain (median of rounds), accepted {acc}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--contexts", default="16,128,512")
    ap.add_argument("--quick", action="store_true", help="3 rounds, 16 tokens")
    ap.add_argument("--synthetic", action="store_true", help="also time generation, drafts all right")
    ap.add_argument("--draft-repeats", type=int, default=7, help="timings per draft step (median)")
    ap.add_argument("--family", choices=FAMILIES, default="deepseek-v3", help="whose MTP layer")
    a = ap.parse_args()
    if a.synthetic and a.family != "deepseek-v3":
        ap.error("--synthetic builds DeepSeek-V3's successor head only")
    if a.quick:
        a.rounds, a.max_tokens = 3, 16
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from expertmesh import LLM

    contexts = [int(c) for c in a.contexts.split(",")]
    with tempfile.TemporaryDirectory() as root:
        path = _checkpoint(root, a.layers, a.hidden, a.family)
        engine = dict(max_model_len=1024, kv_cache_memory_bytes=1 << 26, warmup=False)
        plain = LLM(path, **engine)
        spec = LLM(path, **engine, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
        model, bs = spec.llm_engine.runner.model, spec.llm_engine.blocks.block_size
        # The decode step at each context: a prompt of that length (minus the tokens generated).
        prompts = {n: [5 + i % 400 for i in range(max(1, n - a.max_tokens))] for n in contexts}
        ratios: dict[int, list[float]] = {n: [] for n in contexts}
        decodes, drafts = {n: [] for n in contexts}, {n: [] for n in contexts}
        _decode_per_token(plain, prompts[contexts[0]], 4)  # first-call costs out of the rounds
        seqs = {n: SimpleNamespace() for n in contexts}  # each context's own MTP cache
        for n in contexts:
            _draft(model, n, bs, seqs[n])
        for _ in range(a.rounds):
            for n in contexts:
                d = _decode_per_token(plain, prompts[n], a.max_tokens)
                decodes[n].append(d)
                x = _draft(model, n, bs, seqs[n], a.draft_repeats)
                drafts[n].append(x)
                ratios[n].append(x / d)
        if a.synthetic:
            synthetic = _synthetic(plain, path, root, a.rounds)
    print(f"{a.family} shape: {a.layers} layers + 1 MTP layer, hidden {a.hidden}, {model.cfg.dtype}")
    print(
        f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()}"
    )
    print("| context | decode step ms | draft step ms | draft / decode (median of rounds) | break-even |")
    print("|---|---|---|---|---|")
    for n in contexts:
        r = statistics.median(ratios[n])
        d, x = statistics.median(decodes[n]) * 1e3, statistics.median(drafts[n]) * 1e3
        print(f"| {n} | {d:.2f} | {x:.2f} | {r:.3f} | {r:.3f} |")
    if a.synthetic:
        print(synthetic)


if __name__ == "__main__":
    main()
