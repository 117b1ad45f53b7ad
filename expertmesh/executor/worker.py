"""One rank of an `mp` executor: a spawned process that builds the engine SPMD-style, exactly
as under torchrun (external_launcher), through the engine layer (engine/builder.py), and runs
the `generate` calls or engine steps its parent sends it.

Messages are pickled bytes over a pipe (plain pickle: torch's reducers would route tensors
through shared memory that dies with the sender). The loop ends on "stop", or when the parent
goes away (the pipe closes), so a worker never outlives its parent for long.
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported in worker_main, after the rank's environment is set
    from expertmesh.engine.client import EngineStepper, StepResult
    from expertmesh.engine.llm_engine import LLMEngine


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(pickle.dumps(message))


def recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def worker_main(rank: int, world_size: int, port: int, llm_kwargs: dict[str, Any], conn: Connection) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the parent hosts the store, as torchrun's agent does
        TORCHELASTIC_RESTART_COUNT="0",  # the parent reads the heartbeats of attempt 0
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which tells us
    # torch and the engine load here, after the rank's environment is set and SIGINT ignored (a
    # Ctrl-C during these seconds of imports reaches only the parent); the parent imports this
    # module without them.
    import torch
    import torch.distributed as dist

    from expertmesh.config.engine_args import EngineArgs
    from expertmesh.engine.builder import build_engine
    from expertmesh.engine.client import EngineStepper

    # The ranks share this machine's cores: one rank must not take them all.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        args = EngineArgs.from_kwargs({**llm_kwargs, "distributed_executor_backend": "external_launcher"})
        engine = build_engine(args).engine
        from expertmesh.distributed import watchdog  # as above: the rank's modules load here

        # A watchdog that ends this rank tells the parent why first.
        watchdog.current().on_fire.append(lambda message: send(conn, ("error", message)))
        stepper = EngineStepper(engine)
        ready = {"limits": engine.prompt_limits(), "stats": stepper.rank_stats()}
        ready["warmup_steps"] = engine.num_warmup_steps  # so the parent can see every rank warmed
        send(conn, ("ready", {**ready, "moe": engine.expert_load is not None}))
        _serve_calls(engine, stepper, conn)
    except (EOFError, OSError):
        pass  # the parent is gone: nothing to report to
    except BaseException:
        try:
            send(conn, ("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve_calls(engine: LLMEngine, stepper: EngineStepper, conn: Connection) -> None:
    # as in worker_main: loaded in the rank, not by the parent importing this module
    import torch

    from expertmesh.engine import offline
    from expertmesh.engine.client import StepResult

    leader = offline.is_replica_leader(engine)
    world = engine.groups.world
    ids = itertools.count()

    def interrupted() -> bool:  # an "abort" waiting on this rank's pipe; all ranks must agree
        return bool(world.all_reduce(torch.tensor([int(conn.poll())]), op="max"))

    engine.interrupt = interrupted
    dp_rank = engine.vllm_config.parallel_config.data_parallel_rank
    while True:
        message = recv(conn)
        if message[0] == "stop":
            return
        if message[0] == "step":
            result = step_round(stepper, dp_rank, *message[1:])
            # Every rank of a replica has the same progress; only its leader sends it back.
            send(conn, ("stepped", result if leader else StepResult(stats=result.stats)))
            continue
        if message[0] == "abort":
            continue  # it came after its call had finished anyway
        if message[0] == "expert_load":  # a collective: every rank got the message
            send(conn, ("expert_load", engine.expert_load.snapshot()))
            continue
        _, prompts, params = message
        try:
            outputs = offline.generate(engine, prompts, params, ids)
        except KeyboardInterrupt:  # the driver was interrupted: the requests are aborted
            outputs = None
        # Every rank of a replica has the same outputs; only the replica leader sends them back.
        send(conn, ("done", outputs if leader else None))


def step_round(stepper: EngineStepper, dp_rank: int, adds: list[tuple], aborts: list[str]) -> StepResult:
    """Apply this replica's adds and every abort, then step (every rank steps, for lockstep)."""
    from expertmesh.outputs import RequestOutput  # as in worker_main: loaded in the rank only

    for rid in aborts:
        stepper.abort_request(rid)
    refused = []
    for replica, rid, ids, params, prompt in adds:
        if replica != dp_rank:
            continue
        error = stepper.add_request(rid, ids, params, prompt)
        if error:  # the driver checks prompts by the same rule, so this is not expected
            refused.append(RequestOutput(rid, prompt, ids, [], True, error))
    result = stepper.step()
    result.finished += refused
    return result
