"""Where a layout's numbers part from one process's: per-layer hidden states, side by side.

Runs one prompt's prefill in one process and under a layout (spawned with torchrun), records
the output of the embedding, each layer's attention and MLP/MoE block, each layer, the final
norm and the logits (forward hooks, first call only), and prints for each how many elements
differ and by how much. In float32 every row should read 0; in bf16 a layout that rounds a
partial sum before summing it shows from the first layer on (many elements, several ulps),
while float32 summation order shows as a handful of one-ulp differences.

    .venv/bin/python tools/layer_diff.py --model DIR --dtype bfloat16 --tp 2
    .venv/bin/python tools/layer_diff.py --model DIR --dtype bfloat16 --dp 2 --tp 2 --backend naive
    .venv/bin/python tools/layer_diff.py --model DIR --dtype bfloat16 --dp 2 --ep --backend alltoall

`--reduce-dtype bfloat16` sums partials in bf16 instead (Group.reduce_dtype), for comparison.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch


def capture(llm, prompt: list[int]) -> dict[str, torch.Tensor]:
    """Run the prompt's prefill; the first output of every recorded module, by name."""
    from expertmesh import SamplingParams

    model = llm.llm_engine.runner.model
    seen: dict[str, torch.Tensor] = {}
    wanted = ("embed_tokens", "self_attn", "mlp", "block_sparse_moe", "norm", "lm_head")
    hooks = []
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in wanted or (name.startswith("model.layers.") and last.isdigit()):

            def hook(_m, _inputs, out, name=name):
                if name not in seen and isinstance(out, torch.Tensor):
                    seen[name] = out.detach().float().clone()

            hooks.append(module.register_forward_hook(hook))
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    for h in hooks:
        h.remove()
    return seen


def engine(args, world: int):
    from expertmesh import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        tensor_parallel_size=args.tp if world > 1 else 1,
        data_parallel_size=args.dp if world > 1 else 1,
        pipeline_parallel_size=args.pp if world > 1 else 1,
        enable_expert_parallel=args.ep and world > 1,
        all2all_backend=args.backend if world > 1 else "allgather_reducescatter",
        distributed_executor_backend="external_launcher" if world > 1 else None,
        max_model_len=256,
        kv_cache_memory_bytes=1 << 26,
    )


def worker(args) -> None:
    """One torchrun rank: record, and save what the first DP replica's TP rank 0 holds."""
    llm = engine(args, args.dp * args.pp * args.tp)
    if hasattr(llm.llm_engine.groups, "set_reduce_dtype"):  # absent before partials went float32
        llm.llm_engine.groups.set_reduce_dtype(getattr(torch, args.reduce_dtype))
    seen = capture(llm, args.prompt)
    groups = llm.llm_engine.groups
    dp = groups.layout.coords(groups.global_rank)[0]
    if dp == 0 and groups.tp.rank_in_group == 0:
        torch.save(seen, os.path.join(args.out, f"stage{groups.pp.rank_in_group}.pt"))


def compare(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    print(f"{'module':36} {'differ':>14} {'max |diff|':>11} {'max |ref|':>10}")
    for name, want in ref.items():
        if name not in got:
            print(f"{name:36} {'(absent)':>14}")
            continue
        have = got[name]
        if have.shape != want.shape:
            print(f"{name:36} shape {tuple(have.shape)} != {tuple(want.shape)}")
            continue
        diff = (have - want).abs()
        n = int((diff > 0).sum())
        print(f"{name:36} {n:>7}/{diff.numel():<7}{diff.max().item():11.3g} {want.abs().max().item():10.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", action="store_true", help="enable_expert_parallel")
    p.add_argument("--backend", default="allgather_reducescatter")
    p.add_argument("--reduce-dtype", default="float32", help="Group.reduce_dtype: float32 or bfloat16")
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prompt", type=lambda s: [int(t) for t in s.split(",")], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    world = args.dp * args.pp * args.tp
    if world < 2:
        p.error("give a layout of two or more ranks (--dp/--pp/--tp)")
    ref_llm = engine(args, 1)
    vocab = ref_llm.llm_engine.config.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    args.prompt = torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
    ref = capture(ref_llm, args.prompt)
    del ref_llm
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", __file__]
        cmd += ["--worker", "--out", out, "--prompt", ",".join(map(str, args.prompt))]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in FORWARDED and v]
        cmd += ["--ep"] if args.ep else []
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        got: dict[str, torch.Tensor] = {}
        for name in sorted(os.listdir(out)):
            got.update(torch.load(os.path.join(out, name)))
    print(f"DP{args.dp} PP{args.pp} TP{args.tp} EP={args.ep} {args.backend}, {args.dtype}, "
          f"partials summed in {args.reduce_dtype}, prompt of {args.prompt_len} tokens")  # fmt: skip
    compare(ref, got)


FORWARDED = ("model", "dtype", "dp", "pp", "tp", "backend", "reduce_dtype")

if __name__ == "__main__":
    main()
