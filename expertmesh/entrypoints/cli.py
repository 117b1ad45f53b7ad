"""`expertmesh generate ...`: prompts in, completions printed, with vLLM's parallel flags."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from expertmesh.config import ALL2ALL_BACKEND_NAMES
from expertmesh.entrypoints import stats_cli
from expertmesh.model_source import DEFAULT_MODEL_DIR


def _quantization(name: str) -> str:
    """A scheme LLM(quantization=...) takes, suffixes included ("int4-g32", "int8+head"), or
    "dequantize"."""
    from expertmesh.layers.quantization.online import OnlineScheme
    from expertmesh.layers.quantization.registry import DEQUANTIZE

    if name == DEQUANTIZE:
        return name
    try:
        OnlineScheme.parse(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="local HF directory or hub id (default: the embedded tiny PhiMoE)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16 or float16")
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        type=_quantization,
        help="online quantization of an unquantized checkpoint: weight-only int8 / int4 / fp8, or w8a8 / "
        "w4a8 (int8 / int4 weights, int8 activations); suffixes -g32 (inputs a scale), -ch (one a "
        "channel), +head (the LM head too); a quantized checkpoint's own format is read from its config.json "
        "and its codes held as stored, or dequantized to the model dtype at load with 'dequantize'",
    )
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="TP ranks per replica")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages")
    p.add_argument(
        "--enable-expert-parallel", action="store_true", help="place whole experts over the EP group"
    )
    p.add_argument(
        "--all2all-backend",
        choices=ALL2ALL_BACKEND_NAMES,
        default=None,
        help="MoE token exchange (default allgather_reducescatter; VLLM_ALL2ALL_BACKEND is honoured)",
    )
    p.add_argument(
        "--distributed-executor-backend",
        default=None,
        choices=["external_launcher", "mp"],
        help="external_launcher: one engine per torchrun process (set automatically under torchrun); "
        "mp: this process spawns one worker per rank (what `serve` uses for several ranks)",
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)"
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one batch")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="tokens one step computes (default 8192)"
    )
    switches = (
        ("chunked-prefill", "split long prompts over steps"),
        ("prefix-caching", "reuse shared prefixes' KV"),
    )
    for name, what in switches:
        p.add_argument(f"--enable-{name}", action=argparse.BooleanOptionalAction, default=True, help=what)
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache size per rank (default: 10%% of free RAM on CPU, capped at what is useful)",
    )
    p.add_argument("--enable-eplb", action="store_true", help="expert-parallel load balancing (needs EP)")
    p.add_argument(
        "--num-redundant-experts", type=int, default=None, help="EPLB: replica slots beyond the experts"
    )
    p.add_argument(
        "--eplb-config",
        type=json.loads,
        default=None,
        help='EPLB as JSON: {"num_redundant_experts": R, "step_interval": N (default 3000; 0 = never), '
        '"window_size": W (place by the last W forwards; default: since the last rebalance), '
        '"load_path": "an --expert-stats file to place experts at start-up", "log_balancedness": true}',
    )
    p.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='speculative decoding as JSON (vLLM\'s keys): {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_min": A, "prompt_lookup_max": B} (docs/speculative_decoding.md)',
    )
    p.add_argument("--seed", type=int, default=0, help="engine seed (and the sampling seed below)")
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the start-up warm-up (dummy requests of every step shape before the first request)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="layout- and batch-invariant sums: every layout gives one process's logprobs bit for bit, "
        "bf16 included, at a cost in speed (docs/layouts.md)",
    )
    p.add_argument(
        "--distributed-timeout-seconds",
        type=float,
        default=60.0,  # = distributed.watchdog.DEFAULT_TIMEOUT_S (not imported: --help stays fast)
        help="how long a rank may stop answering before the watchdog ends every rank, naming it "
        "(default %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertmesh", description="MoE inference over DP x PP x TP x EP ranks"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts and print them")
    _add_engine_flags(gen)
    gen.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    gen.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0 = off)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    gen.add_argument(
        "--expert-stats", default=None, metavar="FILE", help="write the expert load statistics as JSON"
    )
    _add_serve_parser(sub)
    _add_verify_parser(sub)
    stats_cli.add_parser(sub)
    return parser


def _add_verify_parser(sub) -> None:
    verify = sub.add_parser(
        "verify",
        help="run every layout that fits the model and the world and compare every rank with one process",
        description="Runs every (DP, PP, TP, EP, all2all backend) layout with DP x PP x TP = the world "
        "size that the model's sizes allow, compares every rank's greedy tokens with one process, "
        "prints a table, and exits 1 if any rank of any layout differs. The world is torchrun's "
        "(torchrun --nproc-per-node=N -m expertmesh.entrypoints.cli verify ...) or --world N "
        "self-spawned ranks on this machine.",
    )
    verify.add_argument(
        "--model", default=None, help="local HF directory or hub id (default: the embedded tiny PhiMoE)"
    )
    verify.add_argument("--world", type=int, default=None, help="ranks to spawn here (not under torchrun)")
    verify.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16")
    verify.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per prompt")
    verify.add_argument("--max-model-len", type=int, default=128, help="engine max_model_len per layout")
    verify.add_argument(
        "--kv-cache-memory-bytes", type=int, default=1 << 23, help="KV cache per rank and layout"
    )
    verify.add_argument("--json", action="store_true", help="print the rows as JSON")
    verify.add_argument(
        "--no-deterministic",
        dest="deterministic",
        action="store_false",
        help="engines without deterministic=True: compare tokens only (logprobs may differ in the "
        "last bits of bf16, the order of float32 sums)",
    )
    verify.add_argument(
        "--eplb",
        action="store_true",
        help="also run each EP layout with EPLB (2 redundant experts, a rebalance every 2 forwards)",
    )


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model (default: embedded)"
    )
    _add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients pass as `model` (default: MODEL, or expertmesh-default)",
    )
    serve.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=4 << 20,
        help="larger request bodies are refused with 413 (default %(default)s)",
    )
    # tools / reasoning hook (entrypoints/chat_tools.py)
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto" (needs --tool-call-parser)',
    )
    serve.add_argument(
        "--tool-call-parser", default=None, help="how tool calls are read from text: hermes, ..."
    )
    serve.add_argument("--reasoning-parser", default=None, help="split <think> text into reasoning_content")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route but /health and /metrics "
        "(default: the EXPERTMESH_API_KEY environment variable, else no key)",
    )


def _engine_kwargs(args: argparse.Namespace, model: str | None) -> dict:
    """LLM(...) keywords from the engine flags shared by `generate` and `serve`."""
    return dict(
        model=model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        quantization=args.quantization,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        all2all_backend=args.all2all_backend,
        distributed_executor_backend=args.distributed_executor_backend,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        distributed_timeout_seconds=args.distributed_timeout_seconds,
        enable_eplb=args.enable_eplb,
        num_redundant_experts=args.num_redundant_experts,
        eplb_config=args.eplb_config,
        warmup=args.warmup,
        speculative_config=args.speculative_config,
        deterministic=args.deterministic,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(parser, args)
    if args.command == "verify":
        return _verify(parser, args)
    if args.command == "stats":
        return stats_cli.main(args)
    from expertmesh import LLM, SamplingParams  # after parsing: --help stays fast
    from expertmesh.config import ParallelConfig

    llm = LLM(**_engine_kwargs(args, args.model))
    engine = getattr(llm, "llm_engine", None)
    # Under DP (torchrun), each replica takes every DP-th prompt; one rank per replica prints. The
    # caller of an mp executor hands out every prompt and gets every output: it prints as one rank.
    pc = engine.vllm_config.parallel_config if engine is not None else ParallelConfig()
    prompts = args.prompt[pc.data_parallel_rank :: pc.data_parallel_size]
    sp = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    load = llm.expert_load() if llm.is_moe else None  # a collective: every rank asks
    if llm.is_replica_leader():
        _print(outs, args, pc, elapsed, llm)
    if load is not None and pc.rank == 0:
        print(stats_cli.summary(load), file=sys.stderr if args.json else sys.stdout)
        if args.expert_stats:
            stats_cli.write_json(load, args.expert_stats)
    sys.stdout.flush()
    return 0


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from expertmesh.entrypoints.serve import serve

    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r} differ; give one")
    kwargs = _engine_kwargs(args, args.model_tag or args.model)
    from expertmesh.entrypoints import chat_tools  # tools / reasoning hook

    try:
        chat_tools.configure(
            chat_tools.ToolOptions(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)
        )
    except ValueError as exc:
        parser.error(str(exc))
    api_key = args.api_key or os.environ.get("EXPERTMESH_API_KEY") or None
    serve(kwargs, args.host, args.port, args.served_model_name, args.max_request_body_bytes, api_key)
    return 0


def _verify(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from expertmesh.distributed.launcher import torchrun_env
    from expertmesh.entrypoints import verify

    kw = dict(
        max_tokens=args.max_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        dtype=args.dtype,
        eplb=args.eplb,
        deterministic=args.deterministic,
    )
    if torchrun_env() is not None:
        if args.world is not None:
            parser.error("--world is for self-spawned ranks; under torchrun the world is WORLD_SIZE")
        result = verify.verify_under_torchrun(args.model, **kw)
        return 0 if result is None else verify.report(*result, args.json)
    if args.world is None or args.world < 1:
        parser.error("give --world N (ranks to spawn here), or run under torchrun")
    return verify.report(*verify.verify(args.model, args.world, **kw), args.json)


def _print(outs, args, pc, elapsed: float, llm) -> None:
    tag = f"[DP rank {pc.data_parallel_rank}] " if pc.data_parallel_size > 1 else ""
    if args.model is None and pc.rank == 0:
        print(f"(model: the embedded tiny PhiMoE at {DEFAULT_MODEL_DIR}; it writes only simple English)")
    for out in outs:
        if args.json:
            print(
                json.dumps(
                    {
                        "dp_rank": pc.data_parallel_rank,
                        "prompt": out.prompt,
                        "text": out.outputs[0].text,
                        "token_ids": out.outputs[0].token_ids,
                        "error": out.error,
                    }
                )
            )
        elif out.error:
            print(f"{tag}Prompt: {out.prompt!r}\n{tag}Error: {out.error}\n")
        else:
            print(f"{tag}Prompt: {out.prompt!r}\n{tag}Generated text: {out.outputs[0].text!r}\n")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs if o.outputs)
    rate = tokens / max(elapsed, 1e-9)
    line = f"{tag}{len(outs)} prompts, {tokens} tokens in {elapsed:.2f}s ({rate:.1f} tok/s)"
    if getattr(llm, "llm_engine", None) is not None:  # the mp executor's workers keep their traffic
        traffic = llm.all2all_stats()
        line += (
            f"; all2all {pc.all2all_backend}: {traffic['bytes_sent']} bytes sent, "
            f"{traffic['bytes_received']} received"
        )
    print(line, file=sys.stderr if args.json else sys.stdout)
    drafter = getattr(getattr(llm, "llm_engine", None), "drafter", None)
    if drafter is not None:
        print(f"{tag}{drafter.describe()}", file=sys.stderr if args.json else sys.stdout)
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
