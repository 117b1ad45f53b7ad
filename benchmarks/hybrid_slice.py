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
    /work/peers/vllm/bin/python benchmarks/gguf_convert.py \
        --converter /work/peers/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp \
        /tmp/expertmesh-bench/nemotron-3-nano-slice --outtype bf16 --outfile /tmp/nemotron-slice.bf16.gguf
    .venv/bin/python benchmarks/hybrid_slice.py --family nemotron-h --prompt 256 --new 8 \
        --llamacpp-gguf /tmp/nemotron-slice.bf16.gguf --rounds 3

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
from expertmesh.layers.gated_deltanet import RecurrentMixer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Slice:
    directory: str
    config_file: str  # under tests/real_configs/2026/
    hf_class: str
    shape: dict  # overrides of the published config: fewer layers and experts, a small vocabulary
    text_config: bool = False  # the published file wraps the text model (a multimodal checkpoint)

    def config(self) -> dict:
        published = json.loads((ROOT / "tests/real_configs/2026" / self.config_file).read_text())
        if self.text_config:
            text = published["text_config"]
            layers = self.shape["num_hidden_layers"]
            return {**text, **self.shape, "layer_types": text["layer_types"][:layers]}
        config = {**published, **self.shape}
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
        text_config=True,
    ),
    "nemotron-h": Slice(
        "nemotron-3-nano-slice",
        "nemotron-3-nano-30b-a3b.json",
        "NemotronHForCausalLM",
        {"hybrid_override_pattern": "MEM*E", "num_hidden_layers": 5, "n_routed_experts": 16,
         "vocab_size": 512, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
         "pad_token_id": 0},
    ),
}  # fmt: skip


def make_model(family: Slice, cache_dir: str) -> str:
    path = Path(cache_dir) / family.directory
    return cached_checkpoint(path, family.config(), family.hf_class, torch.bfloat16, tokenizer=True)


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
# and a count of new tokens) times the prefill and greedy decode of batch 1 and prints them as JSON.
LLAMA_WORKER = """
import json, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_batch=512, n_threads=int(sys.argv[3]),
            verbose=False)
for line in sys.stdin:
    ask = json.loads(line)
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ask["prompt"])
    t1 = time.perf_counter()
    for _ in range(ask["new"]):
        llm.eval([llm.sample(temp=0.0)])
    t2 = time.perf_counter()
    print(json.dumps({"prefill": t1 - t0, "decode": ask["new"] / (t2 - t1)}), flush=True)
"""


def vs_llamacpp(path: str, gguf: str, python: str, prompt: list[int], new: int, rounds: int) -> None:
    """Batch-1 prefill and decode of our engine and llama.cpp (a worker process on the GGUF of the
    same checkpoint), round after round, interleaved; medians and ratios."""
    import subprocess

    threads = torch.get_num_threads()
    worker = subprocess.Popen(
        [python, "-c", LLAMA_WORKER, gguf, str(len(prompt) + new + 16), str(threads)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    llm = LLM(path, dtype="bfloat16", max_model_len=len(prompt) + new + 8, max_num_seqs=1,
              enable_prefix_caching=False)  # fmt: skip
    many = SamplingParams(temperature=0.0, max_tokens=new + 1, ignore_eos=True)
    res: dict[str, dict[str, list[float]]] = {
        "expertmesh": {"p": [], "d": []},
        "llama.cpp": {"p": [], "d": []},
    }
    try:
        for r in range(rounds + 1):  # round 0 warms both up
            prefill = ttft(llm, prompt)
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], many, use_tqdm=False)
            ours_d = new / (time.perf_counter() - t0 - prefill)
            worker.stdin.write(json.dumps({"prompt": prompt, "new": new}) + "\n")
            worker.stdin.flush()
            theirs = json.loads(worker.stdout.readline())
            if r:
                res["expertmesh"]["p"].append(prefill)
                res["expertmesh"]["d"].append(ours_d)
                res["llama.cpp"]["p"].append(theirs["prefill"])
                res["llama.cpp"]["d"].append(theirs["decode"])
    finally:
        worker.stdin.close()
        worker.wait(timeout=60)
    med = {e: {k: statistics.median(v) for k, v in d.items()} for e, d in res.items()}
    for e, m in med.items():
        print(f"{e:12s} prefill {len(prompt)} tokens: {m['p']:.3f} s; decode: {m['d']:.2f} tokens/s "
              f"(bf16, batch 1, {threads} threads, median of {rounds} interleaved rounds)")  # fmt: skip
    ours_m, theirs_m = med["expertmesh"], med["llama.cpp"]
    print(f"expertmesh / llama.cpp: prefill time {ours_m['p'] / theirs_m['p']:.2f}x, decode speed "
          f"{ours_m['d'] / theirs_m['d']:.2f}x; load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip


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
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds for --llamacpp-gguf")
    args = ap.parse_args()
    if args.quick:
        args.prompt, args.new, args.prefix_rounds = 256, 8, 2
        args.recurrence_steps = args.recurrence_steps or 4
    path = make_model(SLICES[args.family], args.cache)
    print(f"{args.family} slice, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    for batch in args.batches if args.recurrence_steps else ():
        recurrence(path, batch, args.recurrence_steps)
    if args.recurrence_steps:
        recurrence_prefill(path, args.prompt, max(2, args.recurrence_steps // 2))
    if args.only_recurrence:
        return
    if args.llamacpp_gguf:
        prompt = torch.randint(3, 512, (args.prompt,), generator=torch.Generator().manual_seed(2)).tolist()
        vs_llamacpp(path, args.llamacpp_gguf, args.llamacpp_python, prompt, args.new, args.rounds)
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
