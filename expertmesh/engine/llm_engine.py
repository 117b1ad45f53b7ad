"""The engine of one rank: requests in, scheduler + model runner each step, outputs out.

With DP > 1 every step follows the lockstep contract: the DP ranks agree on token counts,
a rank with nothing to run while a peer has work runs a one-token dummy forward, and they
continue while any of them has unfinished work.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from expertmesh.config import EngineConfig
from expertmesh.distributed.group import ParallelGroups
from expertmesh.engine.block_manager import BlockManager
from expertmesh.engine.detokenizer import Detokenizer
from expertmesh.engine.model_runner import ModelRunner
from expertmesh.engine.scheduler import Scheduler
from expertmesh.engine.sequence import Sequence
from expertmesh.outputs import CompletionOutput, RequestOutput
from expertmesh.sampling_params import SamplingParams

log = logging.getLogger("expertmesh")


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None


def validate_prompt(ids: list[int], max_model_len: int, capacity: int, vocab_size: int) -> str | None:
    """Why a prompt cannot run (too long, empty, ids outside the vocabulary), or None."""
    if not ids:
        return "the prompt is empty"
    if len(ids) > max_model_len:
        return f"the prompt has {len(ids)} tokens, longer than max_model_len={max_model_len}"
    if len(ids) > capacity:
        return f"the prompt has {len(ids)} tokens, more than the KV cache holds ({capacity})"
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        return f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
    return None


class LLMEngine:
    def __init__(
        self, config: EngineConfig, runner: ModelRunner, groups: ParallelGroups, tokenizer, dispatchers=()
    ) -> None:
        self.config = self.vllm_config = config
        self.dispatchers = list(dispatchers)  # the MoE layers' all2all backends, for traffic stats
        self.groups, self.runner, self.tokenizer = groups, runner, tokenizer
        log.info("%s", runner.describe_kv())
        num_blocks = self._agree_on_blocks(runner.local_block_budget())
        runner.allocate_kv(num_blocks)
        self.blocks = BlockManager(num_blocks, config.cache_config.block_size)
        self.scheduler = Scheduler(config.scheduler_config, self.blocks)
        self.detok = Detokenizer(tokenizer, config.model_config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.capacity = min(
            config.scheduler_config.max_model_len, num_blocks * config.cache_config.block_size
        )
        self.num_steps = self.num_dummy_steps = 0
        self.last_step_traffic = {"bytes_sent": 0, "bytes_received": 0}
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens)", num_blocks, self.blocks.block_size, self.capacity
        )

    def _agree_on_blocks(self, local: int) -> int:
        """Every rank must use the same block count: the smallest one anyone can afford."""
        t = torch.tensor([local])
        t = self.groups.world.all_reduce(t, op="min") if self.groups.world.world_size > 1 else t
        if int(t) < 1:
            raise ValueError(
                "the KV cache budget holds no block at all; raise kv_cache_memory_bytes "
                f"(one block needs {self.runner.block_bytes()} bytes on this rank)"
            )
        return int(t)

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> Request:
        req = Request(request_id, prompt, list(prompt_token_ids))
        self.requests[request_id] = req
        req.error = self._validate(req.prompt_token_ids)
        if req.error:
            log.warning("request %s rejected: %s", request_id, req.error)
            return req
        for i in range(params.n):
            seq = Sequence(request_id, i, req.prompt_token_ids, params, self.capacity)
            req.seqs.append(seq)
            self.scheduler.add(seq)
        return req

    def _validate(self, ids: list[int]) -> str | None:
        return validate_prompt(ids, **self.prompt_limits())

    def prompt_limits(self) -> dict[str, int]:
        """What `validate_prompt` checks against (an mp driver checks prompts with these)."""
        return {
            "max_model_len": self.config.scheduler_config.max_model_len,
            "capacity": self.capacity,
            "vocab_size": self.config.model_config.vocab_size,
        }

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        for seq in req.seqs if req else []:
            if not seq.is_finished:
                seq.finish("abort")
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def any_rank_unfinished(self) -> bool:
        """Lockstep loop condition: does any DP rank still have work? (all-reduce MAX)"""
        local = torch.tensor([int(self.scheduler.has_work())])
        if self.groups.dp.world_size == 1:
            return bool(local)
        return bool(self.groups.dp.all_reduce(local, op="max"))

    # ---- stepping -------------------------------------------------------------------------
    def step_until_none_left(self) -> Iterator[RequestOutput]:
        """Step until no DP rank has work; yields each request as it finishes (rejected ones first)."""
        yield from self._collect()
        while self.any_rank_unfinished():
            yield from self.step()

    def step(self) -> list[RequestOutput]:
        """One forward pass (or a lockstep dummy) and the outputs of requests that finished."""
        batch = self.scheduler.schedule()
        counts = self._dp_token_counts(batch.num_tokens)
        if not batch:
            if any(counts):
                self._dummy_step(counts)
            return self._collect()
        ids, pos, ctx, last = self.runner.prepare(batch, self.blocks)
        ctx.dp_token_counts = counts
        logits = self._forward_counting(ids, pos, ctx, last)
        seqs = batch.seqs
        tokens, logprobs = self.runner.sample(logits, seqs)
        for seq, token, lp in zip(seqs, tokens, logprobs):
            seq.num_cached_tokens = seq.num_tokens
            self._append(seq, token, lp)
        self.num_steps += 1
        return self._collect()

    def _dp_token_counts(self, local: int) -> list[int]:
        dp = self.groups.dp
        if dp.world_size == 1:
            return [local]
        counts = dp.all_gather(torch.tensor([local])).tolist()
        # An idle rank that must keep step runs a one-token dummy: count it as 1.
        return [c if c or not any(counts) else 1 for c in counts]

    def _dummy_step(self, counts: list[int]) -> None:
        ids, pos, ctx, last = self.runner.dummy_inputs()
        ctx.dp_token_counts = counts
        self._forward_counting(ids, pos, ctx, last)
        self.num_dummy_steps += 1

    def _forward_counting(self, ids, pos, ctx, last):
        """The runner's forward, noting the bytes the MoE exchange moved in this step."""
        before = self.traffic()
        logits = self.runner.forward(ids, pos, ctx, last)
        after = self.traffic()
        self.last_step_traffic = {k: after[k] - before[k] for k in after}
        return logits

    def traffic(self) -> dict[str, int]:
        stats = [b.stats for b in self.dispatchers]
        return {k: sum(int(s[k]) for s in stats) for k in ("bytes_sent", "bytes_received")}

    def _append(self, seq: Sequence, token: int, logprob) -> None:
        seq.output_token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
            seq.cumulative_logprob += logprob[token].logprob
        reason = self.detok.check_stop(seq)
        if reason is None and len(seq.output_token_ids) >= seq.max_output_tokens():
            reason = ("length", None)
        if reason is not None:
            seq.finish(*reason)
            self.scheduler.finish(seq)

    def _collect(self) -> list[RequestOutput]:
        done = [r for r in self.requests.values() if r.error or all(s.is_finished for s in r.seqs)]
        for req in done:
            del self.requests[req.request_id]
        return [self._output(r) for r in done]

    def _output(self, req: Request) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=s.index,
                text=self.detok.final_text(s),
                token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in req.seqs
        ]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, True, req.error)

    def stats(self) -> dict:
        return {
            "steps": self.num_steps,
            "dummy_steps": self.num_dummy_steps,
            "preemptions": self.scheduler.num_preemptions,
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_free": self.blocks.num_free,
        }
