"""Profile expertmesh's decode steps on the small MoE: where one step's time goes, at a given batch.

Prefills `--batch` requests, runs a few warm-up decode steps, times `--steps` plain decode steps,
then profiles the same number again with pyinstrument (Python call tree) or torch.profiler (ops).

    .venv/bin/python benchmarks/profile_decode.py --batch 1 --tool pyinstrument
    .venv/bin/python benchmarks/profile_decode.py --batch 32 --tool torch
    .venv/bin/python benchmarks/profile_decode.py --batch 32 --tool kernels --prompt-len 384
    .venv/bin/python benchmarks/profile_decode.py --quantization w8a8 --threads 1 --cpu-time --tool kernels
    .venv/bin/python benchmarks/profile_decode.py --threads 1 --cpu-time --tool whole-step-ab --steps 40
    .venv/bin/python benchmarks/profile_decode.py --model /tmp/gpt-oss-2of24-v --dtype bfloat16 --tool kernels
    .venv/bin/python benchmarks/profile_decode.py --model /work/bigfiles/gpt-oss-20b.gguf --dtype bfloat16 \
        --tool native-ab --steps 8 --rounds 8
    .venv/bin/python benchmarks/profile_decode.py --threads 1 --cpu-time --tool huge-pages-ab --steps 40
    mkfifo /tmp/ctl; perf record -D -1 --control fifo:/tmp/ctl -F 4999 -o perf.data -- \
        .venv/bin/python benchmarks/profile_decode.py --quantization int8 --threads 1 --tool perf \
        --perf-fifo /tmp/ctl --steps 64; perf report -i perf.data --no-children --sort sym

`--tool whole-step-ab` builds a second engine whose decode steps stop at the native layer call
(embedding, final norm and LM head per op, as before decode_model) and alternates blocks of
`--steps` steps between the two, 15 rounds: medians and the median of the rounds' ratios.
`--tool huge-pages-ab` does the same against a second engine built with expertmesh/huge_pages.py off
(weights and KV cache on 4 KiB pages). `--tool native-ab` alternates one engine's steps with its
native decoders on and off (the per-op path), `--rounds` rounds: one copy of the weights.

torch.profiler sees torch ops only; `--tool kernels` times each call into expertmesh's compiled CPU
kernels (matmuls, routed experts, decode attention, norms, rotary) and attributes the rest of a
step to torch ops and Python.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from make_small_moe import DEFAULT_CACHE, SHAPES, make_small_moe  # noqa: E402

from expertmesh import (  # noqa: E402
    LLM,
    SamplingParams,
    huge_pages,  # noqa: E402
)


def prefilled_engine(
    model: str, dtype: str, batch: int, prompt_len: int, steps: int, native: bool = True,
    quantization: str | None = None,
):  # fmt: skip
    """An engine with `batch` running requests, past their prefill, able to decode `steps` more;
    `native`: EngineArgs.native_decode (whole decoder layers in one C call); `quantization`:
    EngineArgs.quantization (e.g. "int8", "w4a8"; None: the checkpoint's weights as they are)."""
    llm = LLM(
        model=model, dtype=dtype, max_model_len=2048, kv_cache_memory_bytes=1 << 30, max_num_seqs=batch,
        native_decode=native, quantization=quantization,
    )  # fmt: skip
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    vocab = llm.llm_engine.config.model_config.vocab_size
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(3, vocab) for _ in range(prompt_len)], params)
    engine.step()  # the prefill
    return engine


# Wall time by default; --cpu-time takes the process's CPU time instead, which on a shared machine
# does not count the time other processes hold the cores (meant for --threads 1: with more threads
# it also counts OpenMP's spin-waiting).
CLOCK = time.perf_counter


def time_steps(engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = CLOCK()
        engine.step()
        times.append(CLOCK() - start)
    return times


def profile_pyinstrument(engine, steps: int) -> None:
    from pyinstrument import Profiler

    profiler = Profiler(interval=0.0002)
    with profiler:
        time_steps(engine, steps)
    print(profiler.output_text(unicode=True, color=False, show_all=False))


def profile_torch(engine, steps: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        time_steps(engine, steps)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def profile_kernels(engine, steps: int) -> None:
    """Wall time per step in each CpuKernels entry point, and what is left for torch and Python."""
    import collections

    from expertmesh.cpu.cpu_kernels import CpuKernels
    from expertmesh.cpu.quantized import QuantizedMoE

    spent, calls = collections.defaultdict(float), collections.Counter()
    originals = {}
    from expertmesh.cpu.native_decode import decoders

    def timed_call(fn, label: str):
        def timed_native(*args):
            start = CLOCK()
            try:
                return fn(*args)
            finally:
                spent[label] += CLOCK() - start
                calls[label] += 1

        return timed_native

    for native in decoders(engine.runner.model):  # the whole-layer C call (cpu/native_decode.py)
        native.fn = timed_call(native.fn, "decode_layers (native)")
        if native.model_fn is not None:  # whole steps: embedding, layers, norm and head in one call
            native.model_fn = timed_call(native.model_fn, "decode_model (native)")
    for name in ("linear", "moe", "paged_decode", "rms_norm", "rope_cache"):
        originals[name] = fn = getattr(CpuKernels, name)

        def timed(self, *args, _fn=fn, _name=name, **kwargs):
            start = CLOCK()
            try:
                return _fn(self, *args, **kwargs)
            finally:
                label = _name if _name != "linear" else f"linear {args[1].out_features}x{args[1].in_features}"
                spent[label] += CLOCK() - start
                calls[label] += 1

        setattr(CpuKernels, name, timed)
    # quantized routed experts (moe_q / moe_q_ex) go through QuantizedMoE, not CpuKernels.moe
    originals_q = {"moe": QuantizedMoE.moe}

    def timed_q(self, *args, _fn=QuantizedMoE.moe, **kwargs):
        start = CLOCK()
        try:
            return _fn(self, *args, **kwargs)
        finally:
            spent["moe (quantized)"] += CLOCK() - start
            calls["moe (quantized)"] += 1

    QuantizedMoE.moe = timed_q
    try:
        total = sum(time_steps(engine, steps))
    finally:
        for name, fn in originals.items():
            setattr(CpuKernels, name, fn)
        QuantizedMoE.moe = originals_q["moe"]
    if not calls:
        print("no CPU-kernel calls: the kernels are off (no compiler, or EXPERTMESH_DISABLE_CPU_KERNELS)")
    print(f"{'part':<28}{'ms/step':>10}{'calls/step':>12}{'share':>8}")
    for name in sorted(spent, key=spent.get, reverse=True):
        ms, per_step, share = spent[name] / steps * 1e3, calls[name] / steps, spent[name] / total
        print(f"{name:<28}{ms:>10.2f}{per_step:>12.0f}{share:>8.0%}")
    rest = total - sum(spent.values())
    print(f"{'torch ops + Python':<28}{rest / steps * 1e3:>10.2f}{'':>12}{rest / total:>8.0%}")


def alternate(first, second, steps: int, rounds: int) -> tuple[float, float, float]:
    """Blocks of `steps` decode steps on each engine in turn, the order swapped every round:
    the median step time (seconds) of each and the median of the rounds' ratios second / first."""
    a, b = [], []
    for r in range(rounds):
        pair = ((first, a), (second, b))
        for eng, into in pair if r % 2 == 0 else pair[::-1]:
            into.append(sum(time_steps(eng, steps)) / steps)
    return (
        statistics.median(a),
        statistics.median(b),
        statistics.median(y / x for x, y in zip(a, b, strict=True)),
    )


def whole_step_ab(engine, other, steps: int, rounds: int = 15) -> None:
    """`engine` (whole decode steps in one call) against `other` (the native layer call only)."""
    from expertmesh.cpu.native_decode import decoders

    for native in decoders(other.runner.model):
        native.model_fn = None  # NativeDecoder.logits then declines: the model's forward runs
    time_steps(other, 3)
    a, b, ratio = alternate(engine, other, steps, rounds)
    print(
        f"whole step {a * 1e3:.3f} ms, layer call only {b * 1e3:.3f} ms: whole step {ratio:.3f}x as fast"
        " (median of the rounds' ratios)"
    )


def native_ab(engine, steps: int, rounds: int = 15) -> None:
    """One engine, its native decoders taken off and put back in turn: blocks of `steps` steps each
    way, the order swapped every round (the machine's bandwidth drifts between runs; one process
    and one copy of the weights compare the two paths on the same memory)."""
    from expertmesh.cpu.native_decode import NativeDecoder

    held = [
        (m, m.native)
        for m in engine.runner.model.modules()
        if isinstance(getattr(m, "native", None), NativeDecoder)
    ]
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for native in (True, False) if r % 2 == 0 else (False, True):
            for module, dec in held:
                module.native = dec if native else None
            times[native].append(sum(time_steps(engine, steps)) / steps)
    for module, dec in held:
        module.native = dec
    on, off = statistics.median(times[True]), statistics.median(times[False])
    ratio = statistics.median(b / a for a, b in zip(times[True], times[False], strict=True))
    print(
        f"native {on * 1e3:.2f} ms, per-op {off * 1e3:.2f} ms a step: native {ratio:.3f}x as fast"
        " (median of the rounds' ratios)"
    )


def huge_pages_ab(engine, other, steps: int, rounds: int = 15) -> None:
    """`engine` (weights and KV cache on huge pages) against `other` (built with them off)."""
    time_steps(other, 3)
    a, b, ratio = alternate(engine, other, steps, rounds)
    print(
        f"huge pages {a * 1e3:.3f} ms, 4 KiB pages {b * 1e3:.3f} ms: huge pages {ratio:.3f}x as fast"
        " (median of the rounds' ratios)"
    )


def profile_perf(engine, steps: int, fifo: str, rounds: int, batch: int, prompt_len: int) -> None:
    """`rounds` times: fresh requests, their prefill outside the window, then `steps` decode steps
    inside it: the steps are bracketed by "enable" / "disable" on perf record's control fifo, so
    `perf record -D -1 --control fifo:FIFO` samples decode steps only (prefill and loading left out)."""
    rng = random.Random(1)
    vocab = engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    with open(fifo, "w", buffering=1) as ctl:
        for r in range(rounds):
            while engine.has_unfinished_requests():
                engine.step()
            for i in range(batch):
                engine.add_request(
                    f"perf{r}-{i}", [rng.randrange(3, vocab) for _ in range(prompt_len)], params
                )
            engine.step()  # the prefill, outside the window
            ctl.write("enable\n")
            time_steps(engine, steps)
            ctl.write("disable\n")
    print(f"perf: {rounds} x {steps} decode steps sampled")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed, then as many profiled")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--tool", default="pyinstrument",
        choices=[
            "pyinstrument", "torch", "kernels", "perf", "whole-step-ab", "huge-pages-ab", "native-ab", "none"
        ],
    )  # fmt: skip
    ap.add_argument(
        "--perf-fifo", default=None, help="--tool perf: perf record's control fifo (see profile_perf)"
    )
    ap.add_argument("--perf-rounds", type=int, default=10, help="--tool perf: rounds of fresh requests")
    ap.add_argument("--cache-dir", default=DEFAULT_CACHE)
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--model", default=None, help="a model directory or GGUF file instead of --shape's")
    ap.add_argument("--cpu-time", action="store_true", help="CPU time, not wall time (see CLOCK)")
    ap.add_argument("--rounds", type=int, default=15, help="--tool native-ab: rounds of both paths")
    ap.add_argument("--native-decode", default="on", choices=["on", "off"], help="EngineArgs.native_decode")
    ap.add_argument(
        "--quantization", default=None, help="EngineArgs.quantization: int8, int4, w8a8, w4a8, ..."
    )
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    model = args.model or make_small_moe(args.cache_dir, args.dtype, args.shape)
    warm = 3
    native = args.native_decode == "on"
    rounds = (
        15
        if args.tool in ("whole-step-ab", "huge-pages-ab")
        else 2 * args.rounds
        if args.tool == "native-ab"
        else 1
    )
    engine = prefilled_engine(
        model,
        args.dtype,
        args.batch,
        args.prompt_len,
        warm + (1 + rounds) * args.steps,
        native,
        args.quantization,
    )
    time_steps(engine, warm)
    times = time_steps(engine, args.steps)
    ms = statistics.median(times) * 1e3
    print(f"batch {args.batch}: decode step median {ms:.2f} ms, min {min(times) * 1e3:.2f} ms", end="")
    print(f" -> {args.batch / statistics.median(times):.0f} tokens/s")
    if args.tool == "pyinstrument":
        profile_pyinstrument(engine, args.steps)
    elif args.tool == "torch":
        profile_torch(engine, args.steps)
    elif args.tool == "kernels":
        profile_kernels(engine, args.steps)
    elif args.tool == "native-ab":
        native_ab(engine, args.steps, args.rounds)
    elif args.tool in ("whole-step-ab", "huge-pages-ab"):
        huge_pages.ENABLED = args.tool == "whole-step-ab"  # the second engine's weights: 4 KiB pages
        other = prefilled_engine(
            model,
            args.dtype,
            args.batch,
            args.prompt_len,
            warm + rounds * args.steps,
            native,
            args.quantization,
        )
        (whole_step_ab if args.tool == "whole-step-ab" else huge_pages_ab)(engine, other, args.steps, rounds)
    elif args.tool == "perf":
        if not args.perf_fifo:
            ap.error("--tool perf needs --perf-fifo (run under perf record -D -1 --control fifo:FIFO)")
        profile_perf(engine, args.steps, args.perf_fifo, args.perf_rounds, args.batch, args.prompt_len)


if __name__ == "__main__":
    main()
