"""Serving benchmark: open-loop Poisson arrivals against an OpenAI-compatible server.

Requests arrive at exponential intervals (a Poisson process of rate R requests/s) whatever the
server is doing, so queueing shows up in the latencies, as with real users. Each request streams
(`stream: true`), and its time to first token (TTFT), time per output token after the first (TPOT)
and end-to-end latency are measured at the client. Prompt and output lengths follow a
ShareGPT-like mix made locally (log-normal, long-tailed prompts, shorter outputs; no download),
the same for every server and rate (one seed); `--shared-prefix N` puts the same N-token
"system prompt" in front of every prompt (what automatic prefix caching saves). Prompts are
token ids (both expertmesh and vLLM take them) and `ignore_eos` holds each output to its drawn
length.

    .venv/bin/python benchmarks/serving.py --rates 1,2,4 --requests 48 \\
        --json serving.json --plot docs/serving.png    # --plot needs the `bench` extra (matplotlib)
    .venv/bin/python benchmarks/serving.py --model embedded --shared-prefix 128 --rates 1,2,4
    # with vLLM's CPU build on the same model and cores:
    .venv/bin/python benchmarks/serving.py --rates 1,2,4 --vllm-python /work/peers/vllm-venv/bin/python

Each server is started by this script (one at a time, the same model, --threads compute threads)
and stopped after its last rate. See docs/benchmarks.md for measured results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
FIRST_TOKEN_ID = 3  # ids 0-2 are pad, bos and eos in the small models: prompts avoid them


@dataclass(frozen=True)
class Job:
    arrival_s: float  # since the start of the run
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    ok: bool
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


@dataclass
class RateReport:
    server: str
    rate: float
    duration_s: float
    results: list[Result] = field(default_factory=list)

    def summary(self) -> dict:
        ok = [r for r in self.results if r.ok]

        def pct(values: list[float], q: float) -> float:
            values = sorted(v for v in values if not math.isnan(v))
            if not values:
                return math.nan
            return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]

        ttft, tpot, e2e = ([getattr(r, k) for r in ok] for k in ("ttft_s", "tpot_s", "e2e_s"))
        out_tokens = sum(r.output_tokens for r in ok)
        return {
            "server": self.server,
            "rate_rps": self.rate,
            "requests": len(self.results),
            "failed": len(self.results) - len(ok),
            "duration_s": round(self.duration_s, 2),
            "throughput_rps": round(len(ok) / self.duration_s, 3),
            "output_tok_s": round(out_tokens / self.duration_s, 1),
            **{f"ttft_p{q}_ms": round(1e3 * pct(ttft, q), 1) for q in (50, 99)},
            **{f"tpot_p{q}_ms": round(1e3 * pct(tpot, q), 2) for q in (50, 99)},
            **{f"e2e_p{q}_ms": round(1e3 * pct(e2e, q), 1) for q in (50, 99)},
            "first_error": next((r.error for r in self.results if not r.ok), ""),
        }


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


def make_jobs(args: argparse.Namespace, rate: float, vocab: int) -> list[Job]:
    rng = random.Random(args.seed)  # the same prompts at every rate and for every server
    lengths = sharegpt_like_lengths(args.requests, args.seed, args.max_prompt, args.max_output)
    arrivals = random.Random(args.seed + 1)
    # --shared-prefix: one "system prompt" that every request starts with (what prefix caching saves).
    system = random.Random(args.seed + 2)
    prefix = [system.randrange(FIRST_TOKEN_ID, vocab) for _ in range(args.shared_prefix)]
    t, jobs = 0.0, []
    for p_len, o_len in lengths:
        prompt = prefix + [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(p_len)]
        jobs.append(Job(t, prompt, o_len))
        t += arrivals.expovariate(rate)
    return jobs


async def one_request(client: httpx.AsyncClient, model: str, job: Job, start: float) -> Result:
    await asyncio.sleep(max(0.0, start + job.arrival_s - time.perf_counter()))
    sent = time.perf_counter()
    body = {
        "model": model,
        "prompt": job.prompt,
        "max_tokens": job.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    result = Result(ok=False)
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                # A chunk with a choice carries new tokens (its text may be empty: a partial
                # character, or a model without a tokenizer); usage comes last, without one.
                if data.get("choices"):
                    chunks += 1
                    if chunks == 1:
                        result.ttft_s = time.perf_counter() - sent
                if data.get("usage"):
                    result.output_tokens = int(data["usage"]["completion_tokens"])
        result.e2e_s = time.perf_counter() - sent
        result.output_tokens = result.output_tokens or chunks
        result.ok = not math.isnan(result.ttft_s)
        if not result.ok:
            result.error = "no token streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_rate(url: str, model: str, jobs: list[Job], server: str, rate: float) -> RateReport:
    limits = httpx.Limits(max_connections=len(jobs) + 4, max_keepalive_connections=len(jobs) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, model, j, start) for j in jobs))
        return RateReport(server, rate, time.perf_counter() - start, list(results))


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


def start_server(args: argparse.Namespace, server: str, model_dir: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    common = ["--port", str(port), "--max-model-len", str(args.max_model_len), "--dtype", args.dtype]
    if server == "expertmesh":
        exe = Path(sys.executable).with_name("expertmesh")
        kv = ["--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
        cmd = [str(exe), "serve", model_dir, *common, *kv, "--served-model-name", "bench"]
    else:
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_KVCACHE_SPACE=str(max(1, args.kv_cache_bytes >> 30)),
        )
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
        cmd += [*common, "--served-model-name", "bench", "--enforce-eager"]
    log = open(Path(args.log_dir) / f"{server}-server.log", "w")  # noqa: SIM115 -- lives with the server
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


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


def bench_server(args: argparse.Namespace, server: str, model_dir: str, vocab: int) -> list[dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, server, model_dir, port)
    try:
        wait_ready(url, proc, args.startup_timeout)
        # Warm-up outside the timed runs (first-call compilation, allocator growth).
        warm = make_jobs(args, 1e9, vocab)[:2]
        asyncio.run(run_rate(url, "bench", warm, server, 0.0))
        rows = []
        for rate in args.rates:
            report = asyncio.run(run_rate(url, "bench", make_jobs(args, rate, vocab), server, rate))
            rows.append({**report.summary(), "shared_prefix": args.shared_prefix})
            print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for server in sorted({_series(r) for r in rows}):
        mine = [r for r in rows if _series(r) == server]
        rates = [r["rate_rps"] for r in mine]
        for ax, key, label in zip(
            axes,
            ("ttft", "tpot", "output_tok_s"),
            ("TTFT (ms)", "TPOT (ms)", "output tokens/s"),
            strict=True,
        ):
            if key == "output_tok_s":
                ax.plot(rates, [r[key] for r in mine], "o-", label=server)
            else:
                ax.plot(rates, [r[f"{key}_p50_ms"] for r in mine], "o-", label=f"{server} p50")
                ax.plot(rates, [r[f"{key}_p99_ms"] for r in mine], "x--", label=f"{server} p99")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Open-loop Poisson arrivals, ShareGPT-like lengths")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(rows: list[dict]) -> None:
    header = ["server", "shared_prefix", "rate_rps", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms"]
    header += ["tpot_p50_ms", "tpot_p99_ms", "failed"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(r.get(h, 0)) for h in header) + " |")


def _series(row: dict) -> str:
    prefix = row.get("shared_prefix", 0)
    return row["server"] + (f" (+{prefix}-token shared prefix)" if prefix else "")


def rows_from_json(paths: list[str]) -> list[dict]:
    """The rows of earlier runs' --json files (for one plot of several runs)."""
    rows = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        rows += [{"shared_prefix": data["args"].get("shared_prefix", 0), **r} for r in data["rows"]]
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        default=None,
        help="model directory, or 'embedded' for the embedded default model "
        "(default: the small MoE of make_small_moe)",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rates", default="1,2,4", help="comma-separated request rates (requests/s)")
    ap.add_argument("--requests", type=int, default=48, help="requests per rate")
    ap.add_argument("--max-prompt", type=int, default=512, help="longest prompt (tokens)")
    ap.add_argument("--max-output", type=int, default=256, help="longest output (tokens)")
    ap.add_argument(
        "--shared-prefix", type=int, default=0, help="tokens of a system prompt every request starts with"
    )
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu: adds vLLM")
    ap.add_argument("--servers", default=None, help="default: expertmesh (+vllm with --vllm-python)")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--log-dir", default=".", help="where each server's log is written")
    ap.add_argument("--json", default=None, help="write every row here")
    ap.add_argument("--plot", default=None, help="PNG of TTFT / TPOT / throughput per rate (matplotlib)")
    ap.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        help="run nothing: print and plot the rows of these --json files",
    )
    args = ap.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    if any(r <= 0 for r in args.rates):
        ap.error(f"--rates must be positive, got {args.rates}")
    if args.shared_prefix < 0:
        ap.error(f"--shared-prefix must be >= 0, got {args.shared_prefix}")
    if args.shared_prefix + args.max_prompt + args.max_output > args.max_model_len:
        ap.error(
            f"--shared-prefix + --max-prompt + --max-output must fit --max-model-len={args.max_model_len}"
        )
    default = ["expertmesh"] + (["vllm"] if args.vllm_python else [])
    args.servers = args.servers.split(",") if args.servers else default
    if "vllm" in args.servers and not args.vllm_python:
        ap.error("--servers vllm needs --vllm-python")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        rows = rows_from_json(args.from_json)
        print_table(rows)
        if args.plot:
            plot(rows, args.plot)
        return 0
    if args.model is None:
        from make_small_moe import DEFAULT_CACHE, make_small_moe

        args.model = make_small_moe(DEFAULT_CACHE, args.dtype)
    elif args.model == "embedded":
        from expertmesh.config.model_source import DEFAULT_MODEL_DIR

        args.model = str(DEFAULT_MODEL_DIR)
    with open(Path(args.model) / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    args.model = with_tokenizer(args.model, vocab)
    rows = []
    for server in args.servers:
        rows += bench_server(args, server, args.model, vocab)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    if args.plot:
        plot(rows, args.plot)
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
