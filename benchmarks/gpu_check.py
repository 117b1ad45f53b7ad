"""One CUDA GPU: expertmesh's one-process CUDA tokens against transformers on CUDA, and tok/s.

For two families (Mixtral; Qwen3-MoE with q/k norms and 128-dim heads), a tiny random checkpoint
is built with transformers' own classes (tests/checkpoints.py); greedy tokens of 8 prompts of
different lengths must equal transformers' `generate` on the same GPU in float32, and the first
token's full-vocabulary logprobs must match its logits. Then the benchmarks' small MoE
(make_small_moe.py) is timed at batch 1 and 32 (prompt 16, 64 new tokens, median of 3), fp32 and
bf16. Run by scripts/gpu_check.sh; never part of CI (CI is CPU-only). Exits 2 without CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = {"mixtral": {}, "qwen3_moe": {"head_dim": 32}}


def check_family(family: str, workdir: str) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from checkpoints import make_checkpoint, prompts_of_lengths, train_tokenizer
    from transformers import AutoModelForCausalLM

    from expertmesh import LLM, SamplingParams

    tok_dir, path = f"{workdir}/tok", f"{workdir}/{family}"
    train_tokenizer(tok_dir)
    make_checkpoint(family, path, tok_dir, **FAMILIES[family])
    prompts = prompts_of_lengths([1, 3, 7, 12, 20, 33, 5, 48], seed=1)
    llm = LLM(path, device="cuda", max_model_len=256, kv_cache_memory_bytes=1 << 26)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    bad = []
    for i, p in enumerate(prompts):
        x = torch.tensor([p], device="cuda")
        ref = ref_model.generate(x, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        if ref[0, len(p) :].tolist() != ours[i]:
            bad.append(len(p))
    vocab = llm.llm_engine.config.model_config.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=vocab)
    worst = 0.0
    for p, out in zip(prompts, llm.generate([{"prompt_token_ids": q} for q in prompts], one), strict=True):
        with torch.no_grad():
            logits = ref_model(torch.tensor([p], device="cuda")).logits[0, -1].float().log_softmax(-1).cpu()
        lp = out.outputs[0].logprobs[0]
        worst = max(worst, max(abs(lp[t].logprob - logits[t].item()) for t in range(vocab)))
    del llm, ref_model
    torch.cuda.empty_cache()
    status = "ok" if not bad and worst < 1e-3 else "FAILED"
    return (
        f"{family}: tokens {'equal' if not bad else f'differ for prompts of {bad} tokens'}, "
        f"max |logprob difference| {worst:.2e}: {status}"
    )


def throughput(dtype: str, batches: list[int]) -> list[str]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from make_small_moe import make_small_moe

    from expertmesh import LLM, SamplingParams

    model = make_small_moe(dtype=dtype)
    llm = LLM(
        model,
        device="cuda",
        dtype=dtype,
        max_model_len=128,
        kv_cache_memory_bytes=1 << 28,
        max_num_seqs=max(batches),
    )
    lines = []
    g = torch.Generator().manual_seed(0)
    for b in batches:
        prompts = [
            {"prompt_token_ids": torch.randint(3, 3072, (16,), generator=g).tolist()} for _ in range(b)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        lines.append(f"small MoE {dtype} batch {b}: {b * 64 / statistics.median(times):,.0f} tok/s")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,32")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
            "this check needs a machine with one NVIDIA GPU and a CUDA build of torch "
            "(TORCH_SPEC='torch==<version>' make setup)",
            file=sys.stderr,
        )
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    failed = False
    with tempfile.TemporaryDirectory() as workdir:
        for family in FAMILIES:
            line = check_family(family, workdir)
            failed |= line.endswith("FAILED")
            print(line, flush=True)
    for dtype in ("float32", "bfloat16"):
        for line in throughput(dtype, [int(b) for b in args.batch_sizes.split(",")]):
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
