"""Serving benchmark: expertmesh serve against vLLM's CPU server and llama.cpp's server, cold and
warm, at several request rates, with offline `generate` of the same requests as 1.0.

Two workloads (`--workload`), both prompts of random token ids decoded to text (every server
tokenizes the same text with the same tokenizer), greedy, `ignore_eos` holding each output to its
length:
- `fixed` (default): issue 40's `vllm bench serve --dataset-name random --random-input-len 128
  --random-output-len 64 --ignore-eos`: every prompt `--input-len` tokens, every output
  `--output-len`.
- `sharegpt`: a ShareGPT-like length mix made locally (log-normal, long-tailed prompts up to
  `--max-prompt`, shorter outputs up to `--max-output`; no download).
`--shared-prefix N` puts one N-token "system prompt" in front of every prompt (what automatic
prefix caching saves). Each run draws fresh prompts (its own seed; the shared prefix stays), so no
run reuses an earlier run's cached prompts.

The client is an open-loop asyncio one (Poisson arrivals at rate R whatever the server is doing,
so queueing shows in the latencies; or all at once for `inf`) with vLLM's metrics: TTFT (first
streamed chunk), TPOT per request ((latency - TTFT) / (tokens - 1)), ITL (every gap between two
chunks, pooled over requests), E2E (request latency), output tok/s (all output tokens / the run's
wall time); mean, P50 and P99 (nearest rank) each. `--no-stream` measures non-streaming requests
(TTFT = latency).

Per server: start it, wait for /v1/models, run `cold` (the first run after start, at the
saturation rate `inf`), then the warm runs at every rate, then stop it. The servers run one after
another on the same cores, in rounds (`--rounds`), interleaved with the offline reference, so a
load change on a shared machine hits every engine; the table gives the median over rounds and
each saturation row's ratio to offline. Load average and CPU are printed with the table.

    .venv/bin/python benchmarks/bench_serving.py --quick              # <= 5 min, all engines found
    .venv/bin/python benchmarks/bench_serving.py --rounds 2 --num-prompts 64 \\
        --json serving.json --plot docs/serving_bench.svg --markdown serving.md
    .venv/bin/python benchmarks/bench_serving.py --model embedded --workload sharegpt \\
        --shared-prefix 256 --rates 1,2,4,8 --servers expertmesh --no-offline

vLLM is run from its own venv (`--vllm-python`, default /work/peers/vllm/bin/python), llama.cpp's
`llama_cpp.server` from `--llama-python` on a GGUF made from the same checkpoint with llama.cpp's
converter (benchmarks/gguf_convert.py run by this venv's python; cached next to the checkpoint).
A server whose python is missing is skipped with a line saying so. A checkpoint without a
tokenizer (the embedded model) is given one (a sibling directory with a byte-level BPE of its
vocabulary size), since a server streams text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # make_small_moe, gguf_convert

FIRST_TOKEN_ID = 3  # ids 0-2 are pad, bos and eos in the benchmark models
VLLM_PY = "/work/peers/vllm/bin/python"
LLAMA_PY = "/work/peers/llamacpp/bin/python"
LLAMA_SRC = "/work/peers/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp"


@dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int


@dataclass
class Result:
    ok: bool = False
    ttft_s: float = math.nan
    latency_s: float = math.nan
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float:
        n = self.output_tokens
        return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else math.nan


def sharegpt_like_lengths(n: int, seed: int, max_prompt: int, max_output: int) -> list[tuple[int, int]]:
    """(prompt, output) token counts: log-normal like ShareGPT's (prompt median ~ a third of
    max_prompt with a long tail, output median ~ a quarter of max_output), clipped to [4, max]."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        p = int(rng.lognormvariate(math.log(max_prompt / 3), 0.8))
        o = int(rng.lognormvariate(math.log(max_output / 4), 0.7))
        pairs.append((min(max(p, 4), max_prompt), min(max(o, 4), max_output)))
    return pairs


def make_jobs(tokenizer, args: argparse.Namespace, seed: int) -> list[Job]:
    """`args.num_prompts` texts of random token ids (vLLM's random dataset) with the workload's
    lengths, each after the shared prefix (the same for every run: `args.seed`). Decoded, so every
    server tokenizes the same text; re-encoding may merge a few ids, the same for every engine."""
    if args.workload == "fixed":
        lengths = [(args.input_len, args.output_len)] * args.num_prompts
    else:
        lengths = sharegpt_like_lengths(args.num_prompts, seed, args.max_prompt, args.max_output)
    vocab = len(tokenizer)
    system = random.Random(args.seed + 2)
    prefix = [system.randrange(FIRST_TOKEN_ID, vocab) for _ in range(args.shared_prefix)]
    rng = random.Random(seed)
    return [
        Job(tokenizer.decode(prefix + [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(p_len)]), o_len)
        for p_len, o_len in lengths
    ]


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def one_request(client: httpx.AsyncClient, body: dict, at: float, start: float, stream: bool) -> Result:
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    res = Result()
    sent = last = time.perf_counter()
    try:
        if not stream:
            resp = await client.post("/v1/completions", json=body)
            res.latency_s = res.ttft_s = time.perf_counter() - sent
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return res
            res.output_tokens = int(resp.json()["usage"]["completion_tokens"])
            res.ok, res.error = held_to_length(res.output_tokens, body["max_tokens"], "")
            return res
        chunks, texts, finish = 0, 0, None
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                now = time.perf_counter()
                if data.get("choices") and (data["choices"][0].get("text") or not data.get("usage")):
                    chunks += 1
                    texts += bool(data["choices"][0].get("text"))
                    if chunks == 1:
                        res.ttft_s = now - sent
                    else:
                        res.itl_s.append(now - last)
                    last = now
                if data.get("choices"):
                    finish = data["choices"][0].get("finish_reason") or finish
                if data.get("usage"):
                    res.output_tokens = int(data["usage"]["completion_tokens"])
        res.latency_s = time.perf_counter() - sent
        if not res.output_tokens:
            # No usage in the stream (llama-cpp-python): a length stop means max_tokens tokens (it
            # may send several tokens in one chunk, or none for a partial character); else the
            # chunks that carried text.
            res.output_tokens = body["max_tokens"] if finish == "length" else texts
        res.ok, res.error = held_to_length(res.output_tokens, body["max_tokens"], finish)
        if not chunks:
            res.ok, res.error = False, "no chunk streamed"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def held_to_length(got: int, asked: int, finish: str | None) -> tuple[bool, str]:
    """(ok, error): every request asks to be held to its length (ignore_eos or min_tokens), so a
    shorter answer is a failure, not a fast request (a server that ends requests early, e.g.
    one that interrupts a stream for the next request, must not look faster)."""
    if got >= asked:
        return True, ""
    return False, f"stopped after {got} of {asked} tokens (finish_reason {finish!r})"


def request_body(server: str, job: Job) -> dict:
    body = {"model": "bench", "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0.0}
    if server == "llama.cpp":
        # llama-cpp-python has no ignore_eos: min_tokens masks EOS (the benchmark GGUFs' only
        # end-of-generation id) until max_tokens.
        body["min_tokens"] = job.max_tokens
    else:
        body["ignore_eos"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def run_load(
    url: str,
    server: str,
    jobs: list[Job],
    rate: float,
    seed: int,
    stream: bool,
    concurrency: int = 0,
    transport: httpx.AsyncBaseTransport | None = None,
):
    """All jobs at their arrival times; with `concurrency` > 0, at most that many in flight (a job
    due while the limit is reached waits for a slot, as vllm bench serve's --max-concurrency)."""
    limits = httpx.Limits(max_connections=len(jobs) + 4, max_keepalive_connections=len(jobs) + 4)
    times = arrivals(len(jobs), rate, seed)
    slots = asyncio.Semaphore(concurrency or len(jobs))

    async def limited(client: httpx.AsyncClient, job: Job, at: float, start: float) -> Result:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with slots:
            return await one_request(client, request_body(server, job), 0.0, time.perf_counter(), stream)

    timeout = httpx.Timeout(900.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, transport=transport) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(limited(client, j, t, start) for j, t in zip(jobs, times, strict=True))
        )
        return list(results), time.perf_counter() - start


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]

    def mean_p50_p99(values: list[float]) -> tuple[float, float, float]:
        values = sorted(v for v in values if not math.isnan(v))
        if not values:
            return math.nan, math.nan, math.nan

        def rank(q: float) -> float:  # nearest rank
            return 1e3 * values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]

        return 1e3 * statistics.fmean(values), rank(0.5), rank(0.99)

    out = {"requests": len(results), "failed": len(results) - len(ok), "duration_s": duration}
    out["output_tok_s"] = sum(r.output_tokens for r in ok) / duration
    out["request_s"] = len(ok) / duration
    for key, values in (
        ("ttft", [r.ttft_s for r in ok]),
        ("tpot", [r.tpot_s for r in ok]),
        ("itl", [g for r in ok for g in r.itl_s]),
        ("e2e", [r.latency_s for r in ok]),
    ):
        out[f"mean_{key}_ms"], out[f"p50_{key}_ms"], out[f"p99_{key}_ms"] = mean_p50_p99(values)
    out["first_error"] = next((r.error for r in results if not r.ok), "")
    return out


# ------------------------------------------------------------------ servers


def with_tokenizer(model_dir: str, vocab: int) -> str:
    """`model_dir`, or (when it has no tokenizer) a sibling that links its files and adds a
    byte-level BPE of exactly `vocab` ids trained on text shipped with CPython: a server streams
    text, and a tokenizer-less model would hold its text back."""
    src = Path(model_dir)
    if any((src / n).exists() for n in ("tokenizer.json", "tokenizer_config.json")):
        return model_dir
    dst = src.with_name(src.name + "-with-tokenizer")
    if (dst / "tokenizer.json").exists():
        return str(dst)
    # Only for a tokenizer-less checkpoint: these take seconds to import.
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        (tmp / f.name).symlink_to(f.resolve())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(list(topics.values()), trainer)
    short = vocab - tok.get_vocab_size()
    if short > 0:  # the text ran out of merges: fill the rest so every id decodes
        tok.add_tokens([f"<fill{i}>" for i in range(short)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(tmp)
    tmp.rename(dst)
    return str(dst)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready (see its log)")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server at {url} not ready within {timeout} s")


def gguf_for(args) -> str | None:
    outtype = {"float32": "f32", "bfloat16": "bf16"}[args.dtype]
    path = Path(args.model).with_suffix(f".{outtype}.gguf")
    if path.exists():
        return str(path)
    # The converter imports transformers and torch: this venv has them, llama.cpp's may not.
    cmd = [sys.executable, str(HERE / "gguf_convert.py"), "--converter", LLAMA_SRC, args.model]
    cmd += ["--outtype", outtype, "--outfile", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"llama.cpp: GGUF conversion failed, skipped:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return str(path)


def server_cmd(args, server: str, port: int) -> tuple[list[str], dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    p = str(port)
    if server.startswith("expertmesh"):
        server, _, tree = server.partition("@")
        if tree:  # expertmesh@DIR: the package imported from that source tree (before/after a change)
            env["PYTHONPATH"] = tree
        exe = str(Path(sys.executable).with_name("expertmesh"))
        cmd = [exe, "serve", args.model, "--port", p, "--max-model-len", str(args.max_model_len)]
        cmd += ["--dtype", args.dtype, "--served-model-name", "bench"]
        cmd += ["--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
        if server == "expertmesh-nowarmup":
            cmd.append("--no-warmup")
        return cmd, env
    if server == "vllm":
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_KVCACHE_SPACE=str(max(1, args.kv_cache_bytes >> 30)),
        )
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model]
        cmd += ["--port", p]
        cmd += ["--max-model-len", str(args.max_model_len), "--dtype", args.dtype, "--enforce-eager"]
        return cmd + ["--served-model-name", "bench"], env
    gguf = gguf_for(args)
    cmd = [args.llama_python, "-m", "llama_cpp.server", "--model", gguf or "", "--port", p]
    cmd += ["--n_ctx", str(args.max_model_len), "--n_threads", str(args.threads), "--model_alias", "bench"]
    cmd += ["--n_threads_batch", str(args.threads), "--n_batch", "512"]
    # It serves one request at a time, and by default a new request cuts the running one short
    # (finish "length" after a few tokens): queue them instead, as the other servers do.
    return cmd + ["--interrupt_requests", "False"], env


def available(args, server: str) -> bool:
    py = {"vllm": args.vllm_python, "llama.cpp": args.llama_python}.get(server)
    if py is None:
        return True
    mod = "vllm" if server == "vllm" else "llama_cpp.server"
    ok = Path(py).exists()
    ok = ok and subprocess.run([py, "-c", f"import {mod}"], capture_output=True).returncode == 0
    if ok and server == "llama.cpp":
        ok = gguf_for(args) is not None
    if not ok:
        print(f"{server}: not available ({py} cannot import {mod}): skipped", file=sys.stderr)
    return ok


def bench_server(args, server: str, tokenizer, round_no: int) -> list[dict]:
    """The server's cold and warm runs; a server that fails to start gives one row saying so."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd, env = server_cmd(args, server, port)
    log = open(Path(args.log_dir) / f"{server.replace('/', '_')}-server.log", "a")  # noqa: SIM115 -- lives with the server
    t0 = time.perf_counter()
    # Its own process group (vLLM's engine-core and worker processes go down with it), in this
    # session: a session is the kernel's CPU-share group (autogroup), so raising the benchmark's
    # session priority (`echo -15 > /proc/$$/autogroup`) covers the servers it starts too.
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=os.setpgrp)
    rows = []
    try:
        try:
            wait_ready(url, proc, args.startup_timeout)
        except (RuntimeError, TimeoutError) as exc:
            print(f"{server}: {exc}", file=sys.stderr)
            return [{"server": server, "phase": "start", "rate": math.inf, "round": round_no, "failed": 1,
                     "first_error": str(exc), "load": os.getloadavg()[0],
                     "shared_prefix": args.shared_prefix}]  # fmt: skip
        startup = time.perf_counter() - t0
        plan = [("cold", math.inf)] + [("warm", r) for r in args.rates]
        for i, (phase, rate) in enumerate(plan):
            seed = args.seed + 1000 * round_no + 10 * i + 1  # fresh prompts every run: no cache reuse
            jobs = make_jobs(tokenizer, args, seed)
            load = run_load(url, server, jobs, rate, seed, args.stream, args.max_concurrency)
            results, duration = asyncio.run(load)
            row = {"server": server, "phase": phase, "rate": rate, "round": round_no, "startup_s": startup}
            row.update(workload=args.workload, shared_prefix=args.shared_prefix)
            row.update(summarize(results, duration), load=os.getloadavg()[0])
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop_group(proc)
        log.close()
    return rows


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL to whatever is left after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


OFFLINE_SCRIPT = r"""
import json, os, sys, time
from expertmesh.entrypoints.openmp_pool import bound_waiting
bound_waiting(os.environ)  # before torch loads: OpenMP waits as in the `expertmesh` command's servers
from expertmesh import LLM, SamplingParams
spec = json.loads(sys.stdin.read())  # not argv: 64 prompts x 3 runs pass its 128 KiB an argument
llm = LLM(spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
          kv_cache_memory_bytes=spec["kv_cache_bytes"], warmup=spec["warmup"])
for name, prompts, max_tokens in spec["runs"]:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"phase": name, "duration_s": dt, "output_tok_s": n / dt, "requests": len(outs)}
    print(json.dumps(row), flush=True)
"""


def bench_offline(args, tokenizer, round_no: int, warmup: bool) -> list[dict]:
    """expertmesh's LLM.generate of saturation runs (all prompts in one call): the first call
    after construction (cold) and a later one (warm), fresh prompts each."""
    runs = []
    for i, phase in enumerate(("cold", "warm", "warm")):
        jobs = make_jobs(tokenizer, args, args.seed + 1000 * round_no + 500 + i)
        runs.append((phase, [j.prompt for j in jobs], [j.max_tokens for j in jobs]))
    spec = {"model": args.model, "max_model_len": args.max_model_len, "dtype": args.dtype}
    spec.update(runs=runs, warmup=warmup, kv_cache_bytes=args.kv_cache_bytes)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE_SCRIPT],
        input=json.dumps(spec),
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"offline generate failed:\n{done.stderr[-3000:]}")
    name = "offline" if warmup else "offline-nowarmup"
    rows = []
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            rows.append({"server": name, "rate": math.inf, "round": round_no, **d})
            rows[-1].update(workload=args.workload, shared_prefix=args.shared_prefix)
            rows[-1]["load"] = os.getloadavg()[0]
            print(json.dumps(rows[-1]), flush=True)
    # Two warm calls: the second is the reference (the first may still settle allocations).
    return [rows[0], rows[2]]


# ------------------------------------------------------------------ report

COLS = [
    ("output_tok_s", "out tok/s", 0),
    ("mean_ttft_ms", "TTFT mean", 0),
    ("p50_ttft_ms", "TTFT P50", 0),
    ("p99_ttft_ms", "TTFT P99", 0),
    ("mean_tpot_ms", "TPOT mean", 1),
    ("p50_tpot_ms", "TPOT P50", 1),
    ("p99_tpot_ms", "TPOT P99", 1),
    ("mean_itl_ms", "ITL mean", 1),
    ("p99_itl_ms", "ITL P99", 1),
    ("p50_e2e_ms", "E2E P50", 0),
    ("p99_e2e_ms", "E2E P99", 0),
]


def series(row: dict) -> str:
    """The engine's name, with the shared prefix when there is one (several --json files of
    different runs can be reported together)."""
    prefix = row.get("shared_prefix", 0)
    return row["server"] + (f" (+{prefix}-token shared prefix)" if prefix else "")


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per (server, phase, rate): the median over rounds of every metric."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((series(r), r["phase"], r["rate"]), []).append(r)
    out = []
    for (server, phase, rate), rs in groups.items():
        m = {"server": server, "phase": phase, "rate": rate, "rounds": len(rs)}
        for key in [c[0] for c in COLS] + ["load", "failed", "startup_s"]:
            vals = [r[key] for r in rs if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
            m[key] = statistics.median(vals) if vals else math.nan
        out.append(m)
    return out


def markdown(rows: list[dict], args) -> str:
    med = median_rows(rows)
    refs = [r["output_tok_s"] for r in med if r["server"].split(" ")[0] == "offline" and r["phase"] == "warm"]
    ref = refs[0] if refs else math.nan
    head = "| engine | run | rate (req/s) | " + " | ".join(c[1] for c in COLS) + " | x offline | failed |"
    lines = [head, "|" + "---|" * (len(COLS) + 5)]
    for r in med:
        offline = r["server"].startswith("offline")
        rate = "inf" if math.isinf(r["rate"]) else f"{r['rate']:g}"
        cells = [
            "-" if math.isnan(r.get(k, math.nan)) or (k != "output_tok_s" and offline) else f"{r[k]:,.{d}f}"
            for k, _, d in COLS
        ]
        ratio = r["output_tok_s"] / ref if ref == ref and math.isinf(r["rate"]) else math.nan
        ratio_s = "" if math.isnan(ratio) else f"{ratio:.2f}"
        failed = "" if math.isnan(r["failed"]) else f"{r['failed']:.0f}"
        head_cells = f"| {r['server']} | {r['phase']} | {rate} | "
        lines.append(head_cells + " | ".join(cells) + f" | {ratio_s} | {failed} |")
    loads = [r["load"] for r in rows if "load" in r]
    lines.append("")
    if args.workload == "fixed":
        work = f"{args.input_len} prompt tokens and {args.output_len} new tokens"
    else:
        work = f"ShareGPT-like lengths (prompts up to {args.max_prompt}, outputs up to {args.max_output})"
    if args.shared_prefix:
        work += f" after a {args.shared_prefix}-token shared prefix"
    lines.append(
        f"{args.num_prompts} requests of {work} "
        f"per run, {'streaming' if args.stream else 'non-streaming'}, {args.threads} threads, "
        f"{f'at most {args.max_concurrency} in flight, ' if getattr(args, 'max_concurrency', 0) else ''}"
        f"median of {args.rounds} round(s); ms for latencies; load average during the runs "
        f"{min(loads):.1f}-{max(loads):.1f}; CPU: {cpu_name()}."
    )
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or "unknown"


def plot_svg(rows: list[dict], path: str) -> None:
    """Output tok/s and mean TTFT per rate for each engine (matplotlib when importable, else a
    plain bar chart written as SVG by hand)."""
    med = [r for r in median_rows(rows) if r["phase"] == "warm" or r["server"].startswith("offline")]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _plot_svg_by_hand(median_rows(rows), path)
    servers = sorted({r["server"] for r in med if not r["server"].startswith("offline")})
    # (median_rows named each row by its series: engine plus shared prefix)
    rates = sorted({r["rate"] for r in med if not r["server"].startswith("offline")})
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    xs = list(range(len(rates)))
    labels = ["inf" if math.isinf(r) else f"{r:g}" for r in rates]
    for server in servers:
        mine = {r["rate"]: r for r in med if r["server"] == server}
        for ax, key in zip(axes, ("output_tok_s", "mean_ttft_ms", "mean_tpot_ms"), strict=True):
            ax.plot(xs, [mine.get(rt, {}).get(key, math.nan) for rt in rates], "o-", label=server)
    off = next((r for r in med if r["server"].split(" ")[0] == "offline" and r["phase"] == "warm"), None)
    if off:
        axes[0].axhline(off["output_tok_s"], color="k", ls="--", lw=1, label="offline generate")
    for ax, title in zip(axes, ("output tok/s", "mean TTFT (ms)", "mean TPOT (ms)"), strict=True):
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def _plot_svg_by_hand(med: list[dict], path: str) -> None:
    bars = [(f"{r['server']} {r['phase']} {r['rate']:g}", r["output_tok_s"]) for r in med]
    top = max((v for _, v in bars if v == v), default=1.0)
    h = 22 * len(bars) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="720" height="{h}" font-size="11">']
    out.append('<text x="10" y="16">output tok/s</text>')
    for i, (name, v) in enumerate(bars):
        y, w = 30 + 22 * i, 0 if v != v else 400 * v / top
        out.append(f'<text x="10" y="{y + 12}">{name}</text>')
        out.append(f'<rect x="250" y="{y}" width="{w:.0f}" height="16" fill="#4477aa"/>')
        out.append(f'<text x="{255 + w:.0f}" y="{y + 12}">{v:,.0f}</text>')
    out.append("</svg>")
    Path(path).write_text("\n".join(out))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default=None,
        help="checkpoint dir, or 'embedded' for the embedded default model (default: make_small_moe's "
        "mixtral-448)",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--workload", default="fixed", choices=["fixed", "sharegpt"], help="see the docstring")
    ap.add_argument(
        "--servers",
        default="expertmesh,vllm,llama.cpp",
        help="also: expertmesh-nowarmup; expertmesh@DIR imports expertmesh from the source tree DIR "
        "(e.g. expertmesh@/path/to/main,expertmesh: before and after a change, interleaved)",
    )
    ap.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--offline-nowarmup", action="store_true", help="also offline generate with LLM(warmup=False)"
    )
    ap.add_argument("--rates", default="1,4,inf", help="warm runs' request rates (requests/s, or inf)")
    ap.add_argument("--num-prompts", "--requests", type=int, default=64, help="requests per run")
    ap.add_argument("--input-len", type=int, default=128, help="fixed workload: prompt tokens")
    ap.add_argument("--output-len", type=int, default=64, help="fixed workload: new tokens")
    ap.add_argument("--max-prompt", type=int, default=512, help="sharegpt workload: longest prompt")
    ap.add_argument("--max-output", type=int, default=256, help="sharegpt workload: longest output")
    ap.add_argument(
        "--shared-prefix", type=int, default=0, help="tokens of a system prompt every request starts with"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved repetitions (median reported)")
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--max-concurrency",
        type=int,
        default=0,
        help="at most this many requests in flight (1: batch-1 decode through the server); 0: no limit",
    )
    ap.add_argument("--quick", action="store_true", help="24 prompts, one round: under 5 min")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--vllm-python", default=VLLM_PY)
    ap.add_argument("--llama-python", default=LLAMA_PY)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--plot", default=None, help="SVG/PNG path")
    ap.add_argument(
        "--from-json", nargs="+", default=None, help="run nothing: report (and plot) earlier --json files"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.rounds = 24, 1
    args.rates = [math.inf if r == "inf" else float(r) for r in args.rates.split(",")]
    if any(r <= 0 for r in args.rates):
        ap.error(f"--rates must be positive or inf, got {args.rates}")
    if args.shared_prefix < 0:
        ap.error(f"--shared-prefix must be >= 0, got {args.shared_prefix}")
    longest = (
        (args.input_len + args.output_len) if args.workload == "fixed" else args.max_prompt + args.max_output
    )
    if args.shared_prefix + longest > args.max_model_len:
        flags = "--input-len + --output-len" if args.workload == "fixed" else "--max-prompt + --max-output"
        ap.error(f"--shared-prefix + {flags} must fit --max-model-len={args.max_model_len}")
    args.servers = [s for s in args.servers.split(",") if s]
    unknown = {s.partition("@")[0] for s in args.servers} - {
        "expertmesh",
        "expertmesh-nowarmup",
        "vllm",
        "llama.cpp",
    }
    if unknown:
        ap.error(f"--servers: unknown {sorted(unknown)}")
    for s in args.servers:
        name, _, tree = s.partition("@")
        if tree and (not name.startswith("expertmesh") or not (Path(tree) / "expertmesh").is_dir()):
            ap.error(f"--servers {s}: NAME@DIR is for expertmesh, with DIR a source tree holding expertmesh/")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        rows = []
        for i, path in enumerate(args.from_json):
            data = json.loads(Path(path).read_text())
            rows += [{"shared_prefix": data["args"].get("shared_prefix", 0), **r} for r in data["rows"]]
            if i == 0:  # the footer describes the first file's run
                for key, value in data["args"].items():
                    if key in ("num_prompts", "input_len", "output_len", "stream", "threads", "rounds",
                               "workload", "max_prompt", "max_output", "shared_prefix",
                               "max_concurrency"):  # fmt: skip
                        setattr(args, key, value)
    else:
        # Both only when measuring: --from-json and --help stay fast.
        if args.model is None:
            from make_small_moe import DEFAULT_CACHE, make_small_moe

            args.model = make_small_moe(DEFAULT_CACHE, args.dtype, "mixtral-448")
        elif args.model == "embedded":
            from expertmesh.config.model_source import DEFAULT_MODEL_DIR

            args.model = str(DEFAULT_MODEL_DIR)
        from transformers import AutoTokenizer

        with open(Path(args.model) / "config.json") as f:
            args.model = with_tokenizer(args.model, json.load(f)["vocab_size"])
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        servers = [s for s in args.servers if available(args, s)]
        rows = []

        def save() -> None:  # after every engine, so a later failure keeps what was measured
            if args.json:
                Path(args.json).write_text(
                    json.dumps({"args": vars(args), "rows": rows}, indent=1, default=str)
                )

        for round_no in range(args.rounds):
            if args.offline:
                rows += bench_offline(args, tokenizer, round_no, warmup=True)
            if args.offline_nowarmup:
                rows += bench_offline(args, tokenizer, round_no, warmup=False)
            save()
            for server in servers:
                rows += bench_server(args, server, tokenizer, round_no)
                save()
    table = markdown(rows, args)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.plot:
        plot_svg(rows, args.plot)
    return 1 if any(r.get("failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
