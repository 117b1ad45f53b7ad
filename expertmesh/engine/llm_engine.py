"""The engine of one rank: requests in, scheduler + model runner each step, outputs out.

With DP > 1 every step follows the lockstep contract: the DP ranks agree on token counts,
a rank with nothing to run while a peer has work runs a one-token dummy forward, and they
continue while any of them has unfinished work.

The request-failure invariant lives here, in `fail`: a request that cannot run (validation) or
whose step raised is finished with its error, its KV blocks are freed, and the other requests
go on. `check_invariants` verifies the block accounting that promise rests on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from expertmesh.config import EngineConfig
from expertmesh.distributed.parallel_groups import ParallelGroups
from expertmesh.engine.block_manager import BlockManager
from expertmesh.engine.detokenizer import Detokenizer
from expertmesh.engine.model_runner import ModelRunner
from expertmesh.engine.request_checks import as_token_ids, bad_words_token_ids, validate_request
from expertmesh.engine.scheduler import Scheduler
from expertmesh.engine.sequence import Sequence
from expertmesh.engine.warmup import WarmUp
from expertmesh.outputs import CompletionOutput, RequestOutput
from expertmesh.sampling_params import SamplingParams
from expertmesh.spec_decode.drafter import build_drafter
from expertmesh.structured_outputs import runtime as structured

log = logging.getLogger("expertmesh")


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None


def prefix_caching_allowed(config: EngineConfig) -> bool:
    """enable_prefix_caching, unless a cached block could differ from a recomputed one: with RoPE
    that depends on the sequence's length (longrope, dynamic) once max_model_len passes its
    switch, a token's rotated key depends on the whole prompt's length, not only its prefix."""
    if not config.cache_config.enable_prefix_caching:
        return False
    rope, max_len = config.model_config.rope, config.scheduler_config.max_model_len
    switch = {"longrope": rope.original_max_position_embeddings, "dynamic": rope.max_position_embeddings}
    if rope.rope_type in switch and switch[rope.rope_type] and max_len > switch[rope.rope_type]:
        log.info(
            "prefix caching is off: rope_type=%r rotates keys by the whole sequence's length past %d "
            "tokens (max_model_len=%d), so a cached block would not equal a recomputed one",
            rope.rope_type, switch[rope.rope_type], max_len,
        )  # fmt: skip
        return False
    return True


class LLMEngine(WarmUp):
    def __init__(
        self, config: EngineConfig, runner: ModelRunner, groups: ParallelGroups, tokenizer, dispatchers=()
    ) -> None:
        self.config = self.vllm_config = config
        self.dispatchers = list(dispatchers)  # the MoE layers' all2all backends, for traffic stats
        self.groups, self.runner, self.tokenizer = groups, runner, tokenizer
        log.info("%s", runner.describe_kv())
        num_blocks = self._agree_on_blocks(runner.local_block_budget())
        runner.allocate_kv(num_blocks)
        slots = self._agree_on_state_slots(runner)
        prefix_caching = prefix_caching_allowed(config) and self._state_allows_prefix_caching(runner)
        self.blocks = BlockManager(
            num_blocks, config.cache_config.block_size, prefix_caching, slots, runner.snapshots
        )
        self.drafter = build_drafter(config, runner, self.blocks.block_size)
        # deterministic mode: a preempted sequence recomputed as it was first computed (scheduler.py)
        exact = bool(getattr(groups.world, "fixed_chunks", 0))
        self.blocks.prompt_blocks_only = exact
        self.scheduler = Scheduler(config.scheduler_config, self.blocks, self.drafter, exact)
        self.detok = Detokenizer(tokenizer, config.model_config.eos_token_ids)
        runner.sampler.eos_ids = self.detok.eos_ids  # min_tokens masks them
        self.requests: dict[str, Request] = {}
        self.capacity = min(
            config.scheduler_config.max_model_len, num_blocks * config.cache_config.block_size
        )
        self.num_steps = self.num_dummy_steps = 0
        self.num_warmup_steps = 0  # forwards `warmup` ran (kept apart from the stats' counters)
        # Asked before each step of step_until_none_left; True ends the call (an mp worker's
        # driver was interrupted). Every rank must give the same answer at the same step.
        self.interrupt: Callable[[], bool] | None = None
        self.last_step_traffic = {"bytes_sent": 0, "bytes_received": 0}
        self.expert_load = None  # engine/expert_load.ExpertLoad for MoE models (set by LLM)
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens)", num_blocks, self.blocks.block_size, self.capacity
        )

    def _agree_on_state_slots(self, runner: ModelRunner) -> int:
        """Hybrid models: the recurrent-state slots every rank affords (the fewest), allocated; they
        bound the running sequences. 0 for a model without recurrent layers. Decided over the
        whole model (every rank agrees): a pipeline stage without recurrent layers (Nemotron-H's
        pattern may leave one so) still takes part, affording max_num_seqs."""
        if not self._model_has_state():
            return 0
        local = runner.local_state_slots if runner.state_layers else self.config.scheduler_config.max_num_seqs
        t = torch.tensor([local])
        t = self.groups.world.all_reduce(t, op="min") if self.groups.world.world_size > 1 else t
        snapshots = int(t) if runner.keeps_snapshots() else 0  # one per slot, budgeted with it
        runner.allocate_states(int(t), snapshots)
        log.info(
            "state cache: %d sequence slots (max_num_seqs=%d) + %d prefix-cache snapshots",
            int(t),
            self.config.scheduler_config.max_num_seqs,
            snapshots,
        )
        return int(t)

    def _model_has_state(self) -> bool:
        return "linear_attention" in self.config.model_config.layer_types

    def _state_allows_prefix_caching(self, runner: ModelRunner) -> bool:
        """A hybrid model caches prefixes with state snapshots at block boundaries (logged)."""
        if self._model_has_state() and runner.keeps_snapshots():
            log.info(
                "prefix caching with recurrent layers: the state after a cached prompt's last full "
                "block is kept as a snapshot (one per sequence slot, evicted with its block); a hit "
                "starts from it"
            )
        return True

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
        self, request_id: str, prompt_token_ids: Any, params: SamplingParams, prompt: str | None = None
    ) -> Request:
        """Queue a request; one that cannot run comes back (and out of the next step) with `.error`."""
        keep = getattr(params, "truncate_prompt_tokens", None)
        if keep is not None and not isinstance(prompt_token_ids, (str, bytes, dict)):
            prompt_token_ids = list(prompt_token_ids)[-keep:]  # vLLM keeps the last N tokens
        error = validate_request(prompt_token_ids, params, **self.prompt_limits())
        ids = as_token_ids(prompt_token_ids)[0]
        if not error and params.bad_words and not params.bad_words_token_ids:
            try:
                params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            except ValueError as exc:
                error = str(exc)
        req = Request(request_id, prompt, ids)
        self.requests[request_id] = req
        if error:
            self.fail(req, error)
            return req
        try:  # structured outputs hook: one matcher per sequence (a bad grammar fails this request)
            vocab = self.config.model_config.vocab_size
            grammars = [structured.start(params, self.tokenizer, vocab) for _ in range(params.n)]
        except ValueError as exc:
            self.fail(req, str(exc))
            return req
        for i in range(params.n):
            seq = Sequence(request_id, i, req.prompt_token_ids, params, self.capacity)
            seq.grammar = grammars[i]
            req.seqs.append(seq)
            self.scheduler.add(seq)
        return req

    def add_failed_request(self, request_id: str, prompt: str | None, error: str) -> Request:
        """A request that failed before it had token ids (tokenization): finished with its error."""
        req = Request(request_id, prompt, [])
        self.requests[request_id] = req
        self.fail(req, error)
        return req

    def fail(self, req: Request, error: str) -> None:
        """The one place a request fails: finished with its error, its KV blocks freed at once."""
        log.warning("request %s failed: %s", req.request_id, error)
        req.error = error
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish("error")
            self.scheduler.finish(seq)

    def prompt_limits(self) -> dict[str, int]:
        """What `validate_request` checks against (an mp driver checks requests with these)."""
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
            if self.interrupt is not None and self.interrupt():
                raise KeyboardInterrupt("the call was interrupted by its driver")
            yield from self.step()

    def step(self) -> list[RequestOutput]:
        """One forward pass (or a lockstep dummy) and the outputs of requests that finished."""
        batch = self.scheduler.schedule()
        counts = self._dp_token_counts(batch.num_tokens)
        if not batch:
            if any(counts):
                self._dummy_step(counts)
            return self._collect()
        try:
            ids, pos, ctx, last = self.runner.prepare(batch, self.blocks)
            ctx.dp_token_counts = counts
            sampled = batch.sampled  # after prepare: it orders the decodes
            drafts = [batch.drafts.get(s.seq_id, []) for s in sampled] if batch.drafts else None
            prompt = self.runner.prompt_logprob_rows(batch, ctx)
            logits = self._forward_counting(ids, pos, ctx, last, [r for _, rows, _ in prompt for r in rows])
            tokens, logprobs, prompt_lps = self.runner.sample(logits, sampled, prompt, drafts)
        except Exception as exc:
            if self.groups.world.world_size > 1:
                raise  # peers are inside the same collectives: no rank can go on alone
            log.exception("an engine step failed; failing the %d requests it ran", len(batch.seqs))
            for rid in dict.fromkeys(s.request_id for s in batch.seqs):
                self.fail(self.requests[rid], f"the engine step failed: {exc!r}")
            return self._collect()
        for (seq, _, first), entries in zip(prompt, prompt_lps, strict=True):
            for index, entry in enumerate(entries, start=first):
                if index == len(seq.prompt_logprobs):  # a recomputed (preempted) prefill adds nothing
                    seq.prompt_logprobs.append(entry)
        for seq in batch.seqs:
            if seq.seq_id not in batch.drafts:  # a verified draft's accepted length is known below
                seq.num_computed_tokens += batch.num_new[seq.seq_id]
                self.blocks.cache_full_blocks(seq)
        if drafts is None:
            for seq, token, lp in zip(sampled, tokens, logprobs, strict=True):
                self._append(seq, token, lp)
        else:
            for seq, draft, new, lps in zip(sampled, drafts, tokens, logprobs, strict=True):
                self._accept(seq, draft, new, lps)
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
        ctx.dp_token_counts, ctx.count_load = counts, False
        self._forward_counting(ids, pos, ctx, last)
        self.num_dummy_steps += 1

    def _forward_counting(self, ids, pos, ctx, last, extra=()):
        """The runner's forward, noting the bytes the MoE exchange moved in this step."""
        if self.expert_load is not None:  # every forward, dummies too: EPLB keeps lockstep by it
            self.expert_load.begin_step()
        before = self.traffic() if self.dispatchers else None  # none in one process: stays zero
        logits = self.runner.forward(ids, pos, ctx, last, list(extra))
        if logits is not None and logits.device.type != "cpu":
            # One sampler for every device: the CPU's (a [B, V] float32 copy a step).
            logits = logits.cpu()
        if self.expert_load is not None:
            self.expert_load.end_step()
        if before is not None:
            after = self.traffic()
            self.last_step_traffic = {k: after[k] - before[k] for k in after}
        return logits

    def traffic(self) -> dict[str, int]:
        stats = [b.stats for b in self.dispatchers]
        return {k: sum(int(s[k]) for s in stats) for k in ("bytes_sent", "bytes_received")}

    def _accept(self, seq: Sequence, draft: list[int], new: list[int], logprobs: list) -> None:
        """A verified sequence's new tokens (the accepted draft tokens and the one after): the KV
        of the rejected ones rolled back (their blocks freed, never keyed in the prefix cache),
        then each appended as a sampled token, so EOS, stop strings and max_tokens inside the
        draft end the sequence where a plain step would have."""
        if not draft:
            self._append(seq, new[0], logprobs[0])
            return
        accepted = len(new) - 1
        self.drafter.observe(seq, len(draft), accepted)
        seq.num_computed_tokens += 1 + accepted  # the last token and the accepted draft tokens
        if accepted < len(draft) and seq.state_slot is not None:  # a hybrid's state: back to the accepted
            self.runner.rollback_state(seq.state_slot, accepted)
        self.blocks.truncate(seq, seq.num_computed_tokens + 1)  # the next token's slot is kept
        for token, lp in zip(new, logprobs, strict=True):
            self._append(seq, token, lp)
            if seq.is_finished:
                return
        self.blocks.cache_full_blocks(seq)  # after the append: a key hashes the accepted tokens

    def _append(self, seq: Sequence, token: int, logprob) -> None:
        seq.output_token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
            seq.cumulative_logprob += logprob[token].logprob
        reason = self.detok.check_stop(seq)
        grammar_end = structured.advance(seq, token)  # structured outputs hook: the grammar's end stops
        if reason is None and grammar_end is not None:
            reason = (grammar_end, None)
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
        cached = req.seqs[0].num_cached_tokens if req.seqs else None
        prompt_lps = req.seqs[0].prompt_logprobs if req.seqs else None
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids, outs, True, req.error, cached, prompt_lps
        )

    def check_invariants(self) -> None:
        """Raise AssertionError unless the KV accounting holds: every block's reference count is the
        number of queued sequences that hold it, free blocks are exactly the unreferenced ones, the
        prefix cache and the blocks' keys agree, and nothing finished is still queued or held."""
        queued = [*self.scheduler.running, *self.scheduler.waiting]
        problems = self.blocks.problems([seq.block_table for seq in queued])
        problems += self.blocks.slot_problems([s.state_slot for s in queued if s.state_slot is not None])
        if len({id(s) for s in queued}) != len(queued):
            problems.append("a sequence is queued twice")
        if any(seq.is_finished for seq in queued):
            problems.append("a finished sequence is still queued")
        if any(seq.block_table for seq in self.scheduler.waiting):
            problems.append("a waiting sequence holds blocks")
        for req in self.requests.values():
            if any(s.is_finished and s.block_table for s in req.seqs):
                problems.append(f"request {req.request_id} has a finished sequence that holds blocks")
        if problems:
            raise AssertionError("KV block accounting is broken: " + "; ".join(problems))

    def stats(self) -> dict:
        return {
            "steps": self.num_steps,
            "dummy_steps": self.num_dummy_steps,
            "preemptions": self.scheduler.num_preemptions,
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_free": self.blocks.num_free,
            # In tokens, as vLLM counts them: prompt tokens looked up, and found, in the prefix cache.
            "prefix_cache_queries": self.blocks.prefix_cache_queries,
            "prefix_cache_hits": self.blocks.prefix_cache_hits,
            **(self.drafter.stats.as_dict() if self.drafter is not None else {}),
        }
