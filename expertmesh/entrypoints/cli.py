"""`expertmesh generate ...`: prompts in, completions printed, with vLLM's parallel flags."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from expertmesh.entrypoints.openmp_pool import bound_waiting

# Before the imports below load torch, whose libgomp reads its wait settings once, when it loads: the
# command's OpenMP workers (and those of the ranks it spawns, which inherit the environment) spin
# only briefly before they sleep, unless the user chose otherwise (openmp_pool.py, docs/server.md).
WAIT_SET = bound_waiting(os.environ)

from expertmesh.config import ParallelConfig  # noqa: E402
from expertmesh.config.engine_args import add_cli_args, from_cli  # noqa: E402
from expertmesh.config.model_source import DEFAULT_MODEL_DIR  # noqa: E402
from expertmesh.entrypoints import stats_cli  # noqa: E402

# Engine defaults a command changes: a server warms every rank before /health answers (its first
# requests would pay the first-use costs); offline, the first generate measured as fast without.
COMMAND_DEFAULTS: dict[str, dict[str, object]] = {"generate": {}, "serve": {"warmup": True}}


def _add_engine_flags(p: argparse.ArgumentParser, **defaults: object) -> None:
    """The engine flags of `generate` and `serve`: one per EngineArgs field (config/engine_args.py)."""
    add_cli_args(p, defaults=defaults)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertmesh", description="MoE inference over DP x PP x TP x EP ranks"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts and print them")
    _add_engine_flags(gen, **COMMAND_DEFAULTS["generate"])
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
    _add_engine_flags(serve, **COMMAND_DEFAULTS["serve"])
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
    return from_cli(args, model=model)


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
    from expertmesh.entrypoints.serve import serve  # fastapi and uvicorn: only for `serve`

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
    from expertmesh.distributed.launcher import torchrun_env  # torch.distributed: only for `verify`
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
