"""A torchrun script for test_faults.py: TP2 on gloo, with one fault chosen by argv[2].

different_prompts   rank 1 passes other prompts of the same lengths
different_counts    rank 1 passes one prompt more
sigstop             rank 1 stops itself (SIGSTOP) inside its third forward pass
stuck               rank 1 sleeps, alive, inside its third forward pass
sigkill             rank 1 kills itself (SIGKILL) inside its third forward pass
none                no fault: both ranks print their tokens
"""

import os
import signal
import sys
import time

from expertmesh import LLM, SamplingParams
from expertmesh.engine.model_runner import ModelRunner

path, fault, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
rank = int(os.environ["RANK"])
llm = LLM(
    path,
    tensor_parallel_size=2,
    distributed_executor_backend="external_launcher",
    max_model_len=64,
    kv_cache_memory_bytes=1 << 22,
    distributed_timeout_seconds=timeout,
)
prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}]
if rank == 1 and fault == "different_prompts":
    prompts[1] = {"prompt_token_ids": [9, 11]}
if rank == 1 and fault == "different_counts":
    prompts.append({"prompt_token_ids": [3]})
if rank == 1 and fault in ("sigstop", "stuck", "sigkill"):
    forward, calls = ModelRunner.forward, [0]

    def faulty(self, *args):
        calls[0] += 1
        if calls[0] == 3:
            print(f"rank 1 freezes ({fault}) at {time.time():.3f}", flush=True)
            if fault in ("sigstop", "sigkill"):
                os.kill(os.getpid(), signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)
            time.sleep(600)
        return forward(self, *args)

    ModelRunner.forward = faulty
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
# one write with its newline: the ranks share a pipe, unbuffered (print's text and newline are two
# writes there, and another rank's line could land between them)
sys.stdout.write(f"rank {rank} tokens {[o.outputs[0].token_ids for o in outs]}\n")
sys.stdout.flush()
