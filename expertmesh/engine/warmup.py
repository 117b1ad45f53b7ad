"""The engine's warm-up (a base class of LLMEngine): before the first request, the shapes the
scheduler will produce run once through the real path, so the first requests run at steady speed,
and nothing of it stays visible to a request."""

from __future__ import annotations

import logging
import time

from expertmesh.engine.block_manager import BlockManager
from expertmesh.engine.scheduler import Scheduler
from expertmesh.sampling_params import SamplingParams

log = logging.getLogger("expertmesh")
# The warm-up's widest decode batch: the per-sequence Python work of a wider one costs start-up
# time (and every test's LLM) while its kernels are those a batch of 64 already ran.
WARMUP_MAX_SEQS = 64
# The warm-up's prefill tokens: enough to reach every expert and the kernels' wide paths; on a CPU no
# shape is compiled, so the whole budget (8192 by default) would only lengthen start-up.
WARMUP_MAX_TOKENS = 1024


class WarmUp:
    """LLMEngine's warm-up methods; they use the engine's config, blocks, scheduler and runner."""

    def warmup_plan(self) -> tuple[int, int, list[int]]:
        """(requests, prompt length, decode batch sizes) of the warm-up: prompts that fill one step's
        token budget between them, then decode batches halving from the largest (max_num_seqs, at
        most WARMUP_MAX_SEQS) down to 1."""
        sc, bs = self.config.scheduler_config, self.blocks.block_size
        n = max(1, min(sc.max_num_seqs, WARMUP_MAX_SEQS))
        sizes = sorted({max(1, n >> k) for k in range(n.bit_length())}, reverse=True)
        new = min(len(sizes) + 1, max(1, self.capacity - 1))
        budget = min(sc.max_num_batched_tokens, WARMUP_MAX_TOKENS)
        prompt = max(1, min(budget // n, self.capacity - new))
        # Every request's blocks at once, so nothing is preempted and every decode batch is whole.
        while n > 1 and n * -(-(prompt + new) // bs) > self.blocks.num_blocks:
            n //= 2
            prompt = max(1, min(budget // n, self.capacity - new))
        sizes = [b for b in sizes if b <= n] or [1]
        return n, prompt, sizes

    def warmup(self) -> int:
        """Run the shapes the scheduler will produce once (a prefill at the token budget, decodes
        at halving batch sizes), through the real path: the CPU kernels' first-use work, the
        weights' and KV cache's pages and the sampler are done before the first request. Leaves
        no trace a request can see: fresh block manager (empty prefix cache) and scheduler, the
        sampler's generator, expert-load counts and exchange stats restored, step counters
        zero. Every rank builds the same requests, so DP ranks step in lockstep. Returns the
        forwards it ran (also `num_warmup_steps`)."""
        if self.requests or self.scheduler.has_work():
            raise RuntimeError("warm-up must run before any request")
        start = time.perf_counter()
        n, prompt, sizes = self.warmup_plan()
        vocab = self.config.model_config.vocab_size
        generator = self.runner.sampler.generator.get_state()
        load, self.expert_load = self.expert_load, None  # no EPLB step, no counted forward
        counts = load.counts.clone() if load is not None else None
        traffic = [dict(b.stats) for b in self.dispatchers]
        try:
            for i in range(n):
                new = 1 + sum(b > i for b in sizes)
                # Half the requests sample (with logprobs): the sampler's random path warms too.
                params = SamplingParams(
                    max_tokens=new, ignore_eos=True, temperature=0.0 if i % 2 else 1.0, logprobs=1
                )
                ids = [(7 * i + 13 * j + 1) % vocab for j in range(prompt)]
                self.add_request(f"warmup-{i}", ids, params)
            for _ in self.step_until_none_left():
                pass
        finally:
            self.requests.clear()
            self.runner.sampler.generator.set_state(generator)
            self.expert_load = load
            if load is not None:
                load.counts.copy_(counts)
            for b, saved in zip(self.dispatchers, traffic, strict=True):
                b.stats.clear()
                b.stats.update(saved)
            self.last_step_traffic = {"bytes_sent": 0, "bytes_received": 0}
            self.num_warmup_steps = self.num_steps + self.num_dummy_steps
            self.num_steps = self.num_dummy_steps = 0
            b = self.blocks  # a fresh one alike (same blocks, prefix caching and state slots), empty
            self.blocks = BlockManager(
                b.num_blocks, b.block_size, b.enable_prefix_caching, b.state_slots, b.snapshots
            )
            self.scheduler = Scheduler(self.config.scheduler_config, self.blocks, self.drafter)
            if self.drafter is not None:
                self.drafter.stats.clear()
        log.info(
            "warm-up: %d forwards (%d requests of %d prompt tokens, decode batches %s) in %.2f s",
            self.num_warmup_steps, n, prompt, sizes, time.perf_counter() - start,
        )  # fmt: skip
        return self.num_warmup_steps
