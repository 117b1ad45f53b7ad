"""Data-parallel (x tensor/pipeline/expert parallel) inference under torchrun, one engine per process.

vLLM's example of the same name, with the import changed. Each DP replica takes every
dp_size-th prompt; with greedy sampling a prompt gives the same text whichever replica runs it.

    torchrun --nproc-per-node=2 examples/offline_inference/torchrun_dp_example.py
    VLLM_ALL2ALL_BACKEND=naive torchrun --nproc-per-node=4 \
        examples/offline_inference/torchrun_dp_example.py --tp-size=2 --dp-size=2 --model <dir>
"""

import argparse

from expertmesh import LLM, SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Data-parallel inference with torchrun")
    p.add_argument("--tp-size", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp-size", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--dp-size", type=int, default=2, help="data parallel size")
    p.add_argument("--enable-ep", action="store_true", help="enable expert parallel")
    p.add_argument("--model", type=str, default=None, help="model directory or hub id (default: embedded)")
    p.add_argument("--max-model-len", type=int, default=None, help="maximum model length")
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.6, help="GPU memory fraction (CUDA only)"
    )
    p.add_argument("--seed", type=int, default=1, help="random seed")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (vLLM's example uses 0.8)")
    p.add_argument("--max-tokens", type=int, default=24, help="new tokens per prompt")
    p.add_argument(
        "--print-all-ranks",
        action="store_true",
        help="every rank prints its outputs (prefixed by its global rank), not only replica leaders",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    prompts = [
        "Hello, my name is",
        "The capital of France is",
        "1 2 3 4 5",
        "Monday Tuesday Wednesday",
        "The president of the United States is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(
        temperature=args.temperature, top_p=0.95, seed=args.seed, max_tokens=args.max_tokens
    )
    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp_size,
        data_parallel_size=args.dp_size,
        pipeline_parallel_size=args.pp_size,
        enable_expert_parallel=args.enable_ep,
        distributed_executor_backend="external_launcher",
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
    )
    dp_rank = llm.llm_engine.vllm_config.parallel_config.data_parallel_rank
    dp_size = llm.llm_engine.vllm_config.parallel_config.data_parallel_size
    prompts = [p for i, p in enumerate(prompts) if i % dp_size == dp_rank]
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    rank = llm.llm_engine.vllm_config.parallel_config.rank
    if args.print_all_ranks or llm.is_replica_leader():  # TP/PP peers hold the same outputs
        prefix = f"Rank: {rank} " if args.print_all_ranks else ""
        for output in outputs:
            print(
                f"{prefix}DP Rank: {dp_rank} Prompt: {output.prompt!r}\n"
                f"Generated text: {output.outputs[0].text!r}\n",
                flush=True,
            )


if __name__ == "__main__":
    main()
