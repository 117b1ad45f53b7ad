"""A slice of a hybrid family at full width: prefill and decode against transformers, and prefill
with a cached prefix against without.

Slices (`--family`), random weights from transformers' class, cached, with the test tokenizer's
512-token vocabulary:

- `qwen3.5`: four layers of Qwen/Qwen3.5-35B-A3B's published text config (hidden 2048; three Gated
  DeltaNet layers with 16 key / 32 value heads of 128, one gated attention layer with 16 query /
  2 KV heads of 256; MoE of expert width 512, top-8, with the gated shared expert), 64 experts
  instead of 256 (~1.6 GB in bf16).
- `nemotron-h`: five layers of nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's published config
  (hidden 2688; pattern MEM*E: Mamba2 with 64 heads of 64 in 8 groups, state 128; MoE of expert
  width 1856, top-6, with the shared expert of 3712; attention with 32 query / 2 KV heads of 128),
  16 experts instead of 128 (~1 GB in bf16).

One prompt of `--prompt` tokens: prefill = time to the first token; decode = tokens per second over
`--new` more tokens (greedy, batch 1); both engines in this process with the same torch threads.
With `--prefix-rounds N`: prompts of `--prompt` shared tokens plus 16 of their own, each timed to
its first token on an engine with prefix caching (after the prefix was computed once: a KV hit
plus the recurrent-state snapshot restored) and on one without, interleaved over N rounds; the
ratio is what to read (the machine's load moves both alike).

    .venv/bin/python benchmarks/hybrid_slice.py --family qwen3.5 --prompt 512 --new 32
    .venv/bin/python benchmarks/hybrid_slice.py --family nemotron-h --prompt 512 --new 16 --prefix-rounds 4
    .venv/bin/python benchmarks/hybrid_slice.py --family nemotron-h --quick   # < 5 min
    .venv/bin/python benchmarks/hybrid_slice.py --family qwen3.5 --recurrence-steps 6 --only-recurrence
    GOMP_SPINCOUNT=3000 .venv/bin/python benchmarks/hybrid_slice.py --family qwen3.5 --experts 16 --quick \
        --llamacpp-gguf /tmp/qwen35-16e.bf16.gguf --llamacpp-f32-gguf /tmp/qwen35-16e.f32.gguf \
        --converter /work/peers/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp

With `--llamacpp-gguf FILE` (written by benchmarks/gguf_convert.py when missing and `--converter` is
given): expertmesh, transformers and llama.cpp interleaved round after round, prefill and decode
timed apart, and their greedy tokens cross-checked (docs/benchmarks.md, "Hybrid slices");
`--llamacpp-f32-gguf` adds llama.cpp and our engine in float32 on the same weights.

With `--recurrence-steps N`: batches of `--batches` sequences decode on one engine whose recurrent
mixers alternate step by step between the compiled decode kernels (cpu/recurrent_kernels.py)
and the torch path (the same weights, states and load): median step time of each, their ratio,
and the median time the mixers' recurrence (conv, state update; `RecurrentMixer.scan`) takes; then
`--prompt`-token prefills alike (the kernels scan a chunk token by token; the torch path runs the
chunked forms, delta_rule_chunked and ssd_chunked).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from checkpoint_cache import cached_checkpoint  # noqa: E402

from expertmesh import LLM, SamplingParams  # noqa: E402
from expertmesh.layers.recurrent_mixer import RecurrentMixer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Slice:
    directory: str
    config_file: str  # under tests/real_configs/2026/
    hf_class: str
    shape: dict  # overrides of the published config: fewer layers and experts, a small vocabulary
    experts_key: str  # the config's routed-expert count
    text_config: bool = False  # the published file wraps the text model (a multimodal checkpoint)

    def config(self, experts: int | None = None) -> dict:
        published = json.loads((ROOT / "tests/real_configs/2026" / self.config_file).read_text())
        shape = self.shape if experts is None else {**self.shape, self.experts_key: experts}
        if self.text_config:
            text = published["text_config"]
            layers = shape["num_hidden_layers"]
            return {**text, **shape, "layer_types": text["layer_types"][:layers]}
        config = {**published, **shape}
        config.pop("auto_map", None)  # transformers' own class, no remote code
        return config


SLICES = {
    "qwen3.5": Slice(
        "qwen3.5-35b-a3b-slice",
        "qwen3.5-35b-a3b.json",
        "Qwen3_5MoeForCausalLM",
        {"num_hidden_layers": 4, "num_experts": 64, "vocab_size": 512, "dtype": "bfloat16",
         "bos_token_id": 1, "eos_token_id": 2, "architectures": ["Qwen3_5MoeForCausalLM"],
         "model_type": "qwen3_5_moe_text"},
        "num_experts",
        text_config=True,
    ),
    "nemotron-h": Slice(
        "nemotron-3-nano-slice",
        "nemotron-3-nano-30b-a3b.json",
        "NemotronHForCausalLM",
        {"hybrid_override_pattern": "MEM*E", "num_hidden_layers": 5, "n_routed_experts": 16,
         "vocab_size": 512, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
         "pad_token_id": 0},
        "n_routed_experts",
    ),
}  # fmt: skip


def make_model(family: Slice, cache_dir: str, experts: int | None = None) -> str:
    path = Path(cache_dir) / (family.directory + ("" if experts is None else f"-{experts}e"))
    config = family.config(experts)
    return cached_checkpoint(path, config, family.hf_class, torch.bfloat16, tokenizer=True)


def ttft(llm: LLM, prompt: list[int]) -> float:
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
    return time.perf_counter() - t0


def prefix_cache(path: str, prefix_len: int, rounds: int) -> None:
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 512, (prefix_len,), generator=g).tolist()
    tails = [torch.randint(3, 512, (16,), generator=g).tolist() for _ in range(rounds + 1)]
    kw = dict(dtype="bfloat16", max_model_len=prefix_len + 64, max_num_seqs=4)
    on, off = LLM(path, **kw), LLM(path, enable_prefix_caching=False, **kw)
    ttft(on, prefix + tails[0])  # computes the prefix (and its state snapshot)
    warm, cold = [], []
    for tail in tails[1:]:  # interleaved: the same load on both
        warm.append(ttft(on, prefix + tail))
        cold.append(ttft(off, prefix + tail))
    hits = on.llm_engine.stats()["prefix_cache_hits"]
    w, c = statistics.median(warm), statistics.median(cold)
    print(f"prefix caching: {prefix_len}+16-token prompts, time to first token (median of {rounds}): "
          f"warm {w:.3f} s, cold {c:.3f} s, warm/cold {w / c:.3f}; {hits} tokens hit")  # fmt: skip


def ours(path: str, prompt: list[int], new: int) -> tuple[float, float]:
    llm = LLM(path, dtype="bfloat16", max_model_len=len(prompt) + new + 8, max_num_seqs=4,
              enable_prefix_caching=False)  # fmt: skip
    ttft(llm, prompt[:16])  # warm-up
    prefill = ttft(llm, prompt)
    t0 = time.perf_counter()
    many = SamplingParams(temperature=0.0, max_tokens=new + 1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], many, use_tqdm=False)
    return prefill, new / (time.perf_counter() - t0 - prefill)


def theirs(path: str, prompt: list[int], new: int) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt])

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    gen(1)  # warm-up
    prefill = gen(1)
    return prefill, new / (gen(new + 1) - prefill)


def recurrence(path: str, batch: int, steps: int, prompt_len: int = 64) -> None:
    """Decode steps alternating kernels / torch path on one engine (see the module's docstring)."""
    llm = LLM(path, dtype="bfloat16", max_model_len=prompt_len + 2 * steps + 8, max_num_seqs=batch,
              max_num_batched_tokens=batch * prompt_len, enable_prefix_caching=False)  # fmt: skip
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), torch.randint(3, 512, (prompt_len,), generator=g).tolist(), params)
    engine.step()  # the prefills
    mixers = [m for m in engine.runner.model.modules() if isinstance(m, RecurrentMixer)]
    compiled = [m.recurrent_steps for m in mixers]
    if any(k is None for k in compiled):
        raise SystemExit("the recurrent kernels are not loaded (no compiler, or disabled)")
    scan_time = [0.0]
    original = RecurrentMixer.scan

    def timed(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            scan_time[0] += time.perf_counter() - t0

    RecurrentMixer.scan = timed
    step_t: dict[str, list[float]] = {"kernels": [], "torch": []}
    scan_t: dict[str, list[float]] = {"kernels": [], "torch": []}
    try:
        for step in range(2 * steps + 2):
            mode = "kernels" if step % 2 == 0 else "torch"
            for m, k in zip(mixers, compiled, strict=True):
                m.recurrent_steps = k if mode == "kernels" else None
            scan_time[0] = 0.0
            t0 = time.perf_counter()
            engine.step()
            if step >= 2:  # one warm-up step of each
                step_t[mode].append(time.perf_counter() - t0)
                scan_t[mode].append(scan_time[0])
    finally:
        RecurrentMixer.scan = original
        for m, k in zip(mixers, compiled, strict=True):
            m.recurrent_steps = k
    st = {m: statistics.median(v) * 1e3 for m, v in step_t.items()}
    sc = {m: statistics.median(v) * 1e3 for m, v in scan_t.items()}
    print(f"batch {batch}: decode step kernels {st['kernels']:.1f} ms, torch {st['torch']:.1f} ms, "
          f"speedup {st['torch'] / st['kernels']:.2f}x; recurrence ({len(mixers)} mixers) kernels "
          f"{sc['kernels']:.2f} ms, torch {sc['torch']:.2f} ms ({sc['torch'] / sc['kernels']:.1f}x); "
          f"median of {steps} steps each, interleaved; load {os.getloadavg()[0]:.2f}",
          flush=True)  # fmt: skip


def recurrence_prefill(path: str, prompt_len: int, rounds: int) -> None:
    """Prefills of `prompt_len` tokens alternating kernels / torch path on one engine."""
    llm = LLM(path, dtype="bfloat16", max_model_len=prompt_len + 8, max_num_seqs=1,
              max_num_batched_tokens=prompt_len, enable_prefix_caching=False)  # fmt: skip
    mixers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, RecurrentMixer)]
    compiled = [m.recurrent_steps for m in mixers]
    prompt = torch.randint(3, 512, (prompt_len,), generator=torch.Generator().manual_seed(4)).tolist()
    times: dict[str, list[float]] = {"kernels": [], "torch": []}
    try:
        for r in range(2 * rounds + 2):
            mode = "kernels" if r % 2 == 0 else "torch"
            for m, k in zip(mixers, compiled, strict=True):
                m.recurrent_steps = k if mode == "kernels" else None
            t = ttft(llm, prompt)
            if r >= 2:
                times[mode].append(t)
    finally:
        for m, k in zip(mixers, compiled, strict=True):
            m.recurrent_steps = k
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"prefill {prompt_len} tokens: kernels {med['kernels']:.3f} s, torch {med['torch']:.3f} s, "
          f"speedup {med['torch'] / med['kernels']:.2f}x (median of {rounds}, interleaved; "
          f"load {os.getloadavg()[0]:.2f})", flush=True)  # fmt: skip


# Runs under llama-cpp-python's own venv: loads the GGUF once, then per line of stdin (a JSON prompt
# and a count of new tokens) times the prefill and greedy decode of batch 1 and prints them as JSON,
# with the greedy tokens and, at each, the gap between its two largest logits (near-ties on random
# weights are where engines may fairly differ).
LLAMA_WORKER = """
import json, sys, time
import numpy as np
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_batch=512, n_threads=int(sys.argv[3]),
            verbose=False)
def pick():  # the last evaluated token's logits (llm.scores is left unfilled by eval here)
    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).astype(np.float64)
    top = np.argsort(logits)[-2:]
    return int(top[1]), float(logits[top[1]] - logits[top[0]])
for line in sys.stdin:
    ask = json.loads(line)
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ask["prompt"])
    t1 = time.perf_counter()
    tokens, gaps = [], []
    for i in range(ask["new"] + 1):
        token, gap = pick()
        tokens.append(token)
        gaps.append(gap)
        if i < ask["new"]:
            llm.eval([token])
    t2 = time.perf_counter()
    print(json.dumps({"prefill": t1 - t0, "decode": ask["new"] / (t2 - t1), "tokens": tokens,
                      "gaps": gaps}), flush=True)
"""


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def agreement(a: list[int], b: list[int]) -> str:
    """How many greedy tokens two engines share, and where they first part."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    first = first_difference(a, b)
    return f"{same}/{len(a)} equal" + ("" if first is None else f", first differs at token {first}")


def ours_timed(llm: LLM, prompt: list[int], new: int, tag: str) -> tuple[float, float, list[int]]:
    """Prefill (to the first token) and decode (tokens/s over `new` more) timed apart, step by step."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=new + 1, ignore_eos=True)
    t0 = time.perf_counter()
    seq = engine.add_request(tag, prompt, params).seqs[0]
    while not seq.output_token_ids:
        engine.step()
    t1 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    t2 = time.perf_counter()
    return t1 - t0, new / (t2 - t1), list(seq.output_token_ids)


def hf_timed(model: torch.nn.Module, prompt: list[int], new: int) -> tuple[float, float, list[int]]:
    """transformers' prefill and greedy decode, timed apart (its own cache, one token a forward)."""
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        t1 = time.perf_counter()
        for _ in range(new):
            out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
        t2 = time.perf_counter()
    return t1 - t0, new / (t2 - t1), tokens


def arbitrate(path: str, prompt: list[int], tokens: dict[str, list[int]]) -> None:
    """transformers in float32 (the same bf16 weights, widened), teacher-forced on each engine's greedy
    tokens: how many of them are its argmax, and at each engine's first miss the reference's gap
    between its choice and the engine's (small gaps are near-ties that rounding may fairly flip)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for e, seq in tokens.items():
        with torch.no_grad():
            logits = model(torch.tensor([prompt + seq[:-1]])).logits[0, len(prompt) - 1 :]
        best = logits.argmax(-1).tolist()
        same = sum(x == y for x, y in zip(seq, best, strict=True))
        first = first_difference(seq, best)
        line = f"float32 transformers teacher-forced on {e}'s tokens: {same}/{len(seq)} are its argmax"
        if first is not None:
            gap = float(logits[first, best[first]] - logits[first, seq[first]])
            line += f"; first miss at token {first}, the reference's gap there {gap:.4f}"
        print(line, flush=True)
    peak_rss("the float32 transformers process")


def llama_tokens(gguf: str, python: str, prompt: list[int], new: int) -> list[int]:
    """llama.cpp's greedy tokens on a GGUF (one request to a fresh worker)."""
    import subprocess

    ask = json.dumps({"prompt": prompt, "new": new}) + "\n"
    out = subprocess.run([python, "-c", LLAMA_WORKER, gguf, str(len(prompt) + new + 16),
                          str(torch.get_num_threads())], input=ask, capture_output=True, text=True,
                         check=True)  # fmt: skip
    return json.loads(out.stdout.splitlines()[-1])["tokens"]


def peak_rss(what: str) -> None:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(f"peak RSS of {what}: {peak:.2f} GiB", flush=True)


def ours_f32_tokens(path: str, prompt: list[int], new: int) -> list[int]:
    """Our engine's greedy tokens in float32 (run in a fresh child process: its memory apart)."""
    llm = LLM(path, dtype="float32", max_model_len=len(prompt) + new + 8, max_num_seqs=1,
              enable_prefix_caching=False)  # fmt: skip
    tokens = ours_timed(llm, prompt, new, "f32")[2]
    peak_rss("the float32 expertmesh process")
    return tokens


def token_check(path: str, prompt: list[int], tokens: dict[str, list[int]], f32_gguf: str | None,
                python: str, new: int) -> None:  # fmt: skip
    """After the timing, each engine in a fresh process in turn (one model in memory at a time): with
    `f32_gguf`, llama.cpp on the float32 GGUF and our engine in float32 (the same weights, no bf16
    rounding of activations) add their tokens; then every token set is arbitrated by float32
    transformers."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        if f32_gguf:
            tokens["llama.cpp f32"] = llama_tokens(f32_gguf, python, prompt, new)
            tokens["expertmesh f32"] = pool.apply(ours_f32_tokens, (path, prompt, new))
            print(f"greedy tokens in float32, expertmesh vs llama.cpp: "
                  f"{agreement(tokens['expertmesh f32'], tokens['llama.cpp f32'])}", flush=True)  # fmt: skip
        pool.apply(arbitrate, (path, prompt, tokens))


def vs_llamacpp(path: str, gguf: str, python: str, prompt: list[int], new: int, rounds: int,
                f32_gguf: str | None = None) -> None:  # fmt: skip
    """Batch-1 prefill and decode of our engine, transformers (both in this process) and llama.cpp
    (a worker process on the GGUF of the same checkpoint, the same bf16 weights), round after round,
    interleaved; medians, ratios, and the three engines' greedy tokens cross-checked."""
    import gc
    import subprocess

    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    worker = subprocess.Popen(
        [python, "-c", LLAMA_WORKER, gguf, str(len(prompt) + new + 16), str(threads)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    llm = LLM(path, dtype="bfloat16", max_model_len=len(prompt) + new + 8, max_num_seqs=1,
              enable_prefix_caching=False)  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    engines = ("expertmesh", "transformers", "llama.cpp")
    res: dict[str, dict[str, list[float]]] = {e: {"p": [], "d": []} for e in engines}
    tokens: dict[str, list[list[int]]] = {e: [] for e in engines}
    gaps: list[list[float]] = []
    try:
        for r in range(rounds + 1):  # round 0 warms all three up
            got = {"expertmesh": ours_timed(llm, prompt, new, f"r{r}")}
            got["transformers"] = hf_timed(hf, prompt, new)
            worker.stdin.write(json.dumps({"prompt": prompt, "new": new}) + "\n")
            worker.stdin.flush()
            theirs_ = json.loads(worker.stdout.readline())
            got["llama.cpp"] = (theirs_["prefill"], theirs_["decode"], theirs_["tokens"])
            if r:
                for e, (p, d, t) in got.items():
                    res[e]["p"].append(p)
                    res[e]["d"].append(d)
                    tokens[e].append(t)
                gaps.append(theirs_["gaps"])
    finally:
        worker.stdin.close()
        worker.wait(timeout=60)
    med = {e: {k: statistics.median(v) for k, v in d.items()} for e, d in res.items()}
    for e, m in med.items():
        print(f"{e:12s} prefill {len(prompt)} tokens: {m['p']:.3f} s; decode: {m['d']:.2f} tokens/s "
              f"(bf16, batch 1, {threads} threads, median of {rounds} interleaved rounds)")  # fmt: skip
    ours_m = med["expertmesh"]
    for e in engines[1:]:
        print(f"expertmesh / {e}: prefill time {ours_m['p'] / med[e]['p']:.2f}x, decode speed "
              f"{ours_m['d'] / med[e]['d']:.2f}x; load {os.getloadavg()[0]:.2f}")  # fmt: skip
    for e in engines:
        if any(t != tokens[e][0] for t in tokens[e]):
            print(f"{e}: greedy tokens differ between rounds")
    ours_t = tokens["expertmesh"][0]
    for e in engines[1:]:
        print(f"greedy tokens, expertmesh vs {e}: {agreement(ours_t, tokens[e][0])}")
    print(f"llama.cpp's top-2 logit gaps over its {new + 1} tokens: min {min(gaps[0]):.4f}, "
          f"median {statistics.median(gaps[0]):.4f}", flush=True)  # fmt: skip
    peak_rss("the benchmark's process (expertmesh and transformers in bf16)")
    del llm, hf
    gc.collect()
    token_check(path, prompt, {e: t[0] for e, t in tokens.items()}, f32_gguf, python, new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(SLICES), default="qwen3.5")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (the shared prefix's too)")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prefix-rounds", type=int, default=0, help="time a cached prefix over N rounds")
    ap.add_argument(
        "--recurrence-steps",
        type=int,
        default=0,
        help="time N decode steps of the kernels and of the torch path, interleaved",
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="for --recurrence-steps")
    ap.add_argument("--only-recurrence", action="store_true", help="skip the transformers comparison")
    ap.add_argument(
        "--quick", action="store_true", help="--prompt 256 --new 8 --prefix-rounds 2 --recurrence-steps 4"
    )
    ap.add_argument("--cache", default="/tmp/expertmesh-bench")
    ap.add_argument("--llamacpp-gguf", help="also compare with llama.cpp on this GGUF of the slice "
                    "(benchmarks/gguf_convert.py), interleaved, batch 1")  # fmt: skip
    ap.add_argument("--llamacpp-python", default="/work/peers/llamacpp/bin/python")
    ap.add_argument("--converter", help="llama.cpp's source dir: write --llamacpp-gguf when missing "
                    "(benchmarks/gguf_convert.py, bf16, no MTP layers: the slice has none)")  # fmt: skip
    ap.add_argument("--llamacpp-f32-gguf", help="a float32 GGUF of the slice: greedy tokens of llama.cpp "
                    "on it and of our engine in float32 are cross-checked too")  # fmt: skip
    ap.add_argument("--converter-python", default="/work/peers/vllm/bin/python",
                    help="a Python with torch and transformers for the converter")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds for --llamacpp-gguf")
    ap.add_argument("--experts", type=int, help="routed experts in the slice (fewer: less memory; "
                    "top-k and expert width stay published); the checkpoint is cached apart")  # fmt: skip
    args = ap.parse_args()
    if args.quick:
        args.prompt, args.new, args.prefix_rounds = 256, 8, 2
        args.recurrence_steps = args.recurrence_steps or (0 if args.llamacpp_gguf else 4)
        args.rounds = min(args.rounds, 2)
    path = make_model(SLICES[args.family], args.cache, args.experts)
    print(f"{args.family} slice, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    for batch in args.batches if args.recurrence_steps else ():
        recurrence(path, batch, args.recurrence_steps)
    if args.recurrence_steps:
        recurrence_prefill(path, args.prompt, max(2, args.recurrence_steps // 2))
    if args.only_recurrence:
        return
    if args.llamacpp_gguf:
        for out, kind in ((args.llamacpp_gguf, "bf16"), (args.llamacpp_f32_gguf, "f32")):
            if args.converter and out and not Path(out).exists():
                import subprocess

                convert = [args.converter_python, str(ROOT / "benchmarks/gguf_convert.py")]
                subprocess.run([*convert, "--converter", args.converter, path, "--outtype", kind, "--no-mtp",
                                "--outfile", out], check=True)  # fmt: skip
        prompt = torch.randint(3, 512, (args.prompt,), generator=torch.Generator().manual_seed(2)).tolist()
        vs_llamacpp(path, args.llamacpp_gguf, args.llamacpp_python, prompt, args.new, args.rounds,
                    args.llamacpp_f32_gguf)  # fmt: skip
        return
    if args.prefix_rounds:
        prefix_cache(path, args.prompt, args.prefix_rounds)
    prompt = torch.randint(3, 512, (args.prompt,), generator=torch.Generator().manual_seed(2)).tolist()
    for name, fn in (("expertmesh", ours), ("transformers", theirs)):
        prefill, tps = fn(path, prompt, args.new)
        print(f"{name:12s} prefill {args.prompt} tokens: {prefill:.3f} s; decode: {tps:.2f} tokens/s "
              f"(bf16, batch 1, {torch.get_num_threads()} threads)")  # fmt: skip


if __name__ == "__main__":
    main()
