"""`expertmesh serve` under torchrun: every process is a rank; global rank 0 also drives.

Every rank builds its engine as under external_launcher (engine/builder.py). Rank 0 answers HTTP
and drives the rounds through `DriverClient`; every other rank `follow`s. One round is a
broadcast of rank 0's command over the world group, then on every rank the same work, then an
all-gather of each rank's StepResult (only replica leaders send progress and outputs). Commands:

- `("step", adds, aborts)`: apply this replica's adds and every abort, run one engine step
  (LLMEngine.step keeps the DP lockstep contract inside the step);
- `("idle",)`: nothing to do; rank 0 sends one about once a second while it has no request, so no
  rank waits in a collective for longer than that and the watchdog can tell idle from hung;
- `("stop",)`: rank 0 is shutting down; every rank returns.

A rank that dies or hangs is found by the watchdog of a rank waiting for it (or by the failed
collective, whose error names it, distributed/watchdog.py); rank 0 then stops the server with
that message, and torchrun ends the other ranks.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from expertmesh.distributed import watchdog
from expertmesh.engine.client import EngineStepper, StepResult
from expertmesh.engine.llm_engine import LLMEngine
from expertmesh.engine.offline import is_replica_leader
from expertmesh.executor.worker import step_round

log = logging.getLogger("expertmesh")
DRIVER = 0  # the global rank that answers HTTP and drives the rounds


class TorchrunExecutor:
    """The StepTransport over torch.distributed (see driver_client.StepTransport)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.world = engine, engine.groups.world
        layout = engine.groups.layout
        self.rank = engine.groups.global_rank
        self.dp_size = layout.dp
        self.leaders = [layout.rank_of(d, 0, 0) for d in range(layout.dp)]
        self.stepper = EngineStepper(engine)
        self._dp_rank = engine.vllm_config.parallel_config.data_parallel_rank
        self._leader = is_replica_leader(engine)
        self._open = True
        info = {"limits": engine.prompt_limits(), "stats": self.stepper.rank_stats()}
        info["warmup_steps"] = engine.num_warmup_steps  # rank 0 sees that every rank warmed
        self.ready_info: dict[int, Any] = dict(enumerate(self.world.all_gather_object(info)))
        role = "answers HTTP and drives" if self.rank == DRIVER else "follows rank 0"
        log.info("serve under torchrun: rank %d pid %d %s", self.rank, os.getpid(), role)

    # ---- rank 0 ------------------------------------------------------------------------------
    def step(self, adds: list[tuple], aborts: list[str]) -> dict[int, StepResult]:
        return self._round(("step", adds, aborts))

    def check_workers(self) -> None:
        """While idle: one empty round (a dead or frozen rank fails it, named by the watchdog)."""
        self._round(("idle",))

    def shutdown(self) -> None:
        """Tell every rank to return (skipped when a round failed: the ranks are gone or stuck)."""
        if self._open and self.rank == DRIVER:
            self._open = False
            try:
                self.world.broadcast_object(("stop",), src=DRIVER)
            except Exception as exc:  # a peer already gone: torchrun ends the rest
                log.warning("could not tell every rank to stop: %s", exc)

    # ---- every rank ----------------------------------------------------------------------------
    def follow(self) -> None:
        """Ranks other than 0: take part in rounds until rank 0 says stop."""
        # Ctrl-C reaches every process of the terminal: rank 0 shuts the server down and then
        # tells the others to stop, which they must be there to hear.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        watchdog.set_doing("serving: following rank 0's rounds")
        while self._round(None) is not None:
            pass
        self._open = False

    def _round(self, command: tuple | None) -> dict[int, StepResult] | None:
        if not self._open:
            raise RuntimeError("the torchrun executor was shut down (or a round failed)")
        try:
            command = self.world.broadcast_object(command, src=DRIVER)
            if command[0] == "stop":
                return None
            if command[0] == "idle":
                return {}
            result = step_round(self.stepper, self._dp_rank, *command[1:])
            # Every rank of a replica has the same progress; only its leader sends it.
            mine = result if self._leader else StepResult(stats=result.stats)
            return dict(enumerate(self.world.all_gather_object(mine)))
        except BaseException:
            self._open = False  # the ranks are out of step now: no further round, no stop message
            raise
