"""`expertmesh serve`: load the model, wrap it in the AsyncEngine, and run uvicorn on the app.

Three ways to hold the ranks: one process; several ranks spawned by this process (the mp
executor); or the processes of a torchrun job (one node or several), where global rank 0
answers HTTP and drives the rounds and every other rank follows (executor/torchrun_executor.py).
With several ranks, a rank that dies or stops answering stops the server, and the exit message
names it.
"""

from __future__ import annotations

import logging
from typing import Any

from expertmesh.config.engine_args import EngineArgs
from expertmesh.distributed.launcher import torchrun_env
from expertmesh.engine.builder import build_engine
from expertmesh.entrypoints.api_server import DEFAULT_MAX_BODY_BYTES, DEFAULT_SERVED_NAME, build_app
from expertmesh.entrypoints.async_engine import AsyncEngine
from expertmesh.entrypoints.llm import LLM
from expertmesh.entrypoints.openmp_pool import describe_waiting
from expertmesh.executor.driver_client import DriverClient
from expertmesh.executor.torchrun_executor import DRIVER, TorchrunExecutor
from expertmesh.logger import setup_logging

log = logging.getLogger("expertmesh")


def serve(
    llm_kwargs: dict[str, Any],
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_names: list[str] | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    api_key: str | None = None,
) -> None:
    """Load the model and serve it until interrupted; exits non-zero, naming the rank, when a rank
    of a multi-rank run dies or hangs."""
    names = served_model_names or [llm_kwargs.get("model") or DEFAULT_SERVED_NAME]
    if _under_torchrun(llm_kwargs):
        return _serve_torchrun(llm_kwargs, host, port, names, max_request_body_bytes, api_key)
    setup_logging()  # the mp path logs here (worker pids, a dead worker) before any rank does
    llm = LLM(**_with_executor(llm_kwargs))
    try:
        _run(
            AsyncEngine(llm),
            names,
            host,
            port,
            max_request_body_bytes,
            stop_on_failure=bool(llm.worker_pids),
            api_key=api_key,
        )
    finally:
        llm.shutdown()


def _serve_torchrun(
    llm_kwargs: dict[str, Any], host: str, port: int, names: list[str], max_body: int, api_key: str | None
) -> None:
    args = EngineArgs.from_kwargs({**llm_kwargs, "distributed_executor_backend": "external_launcher"})
    engine = build_engine(args).engine
    executor = TorchrunExecutor(engine)
    if executor.rank != DRIVER:
        executor.follow()  # until rank 0 stops (or a peer's failure ends this process)
        return
    _run(AsyncEngine(DriverClient(executor, engine.tokenizer)), names, host, port, max_body, True, api_key)


def _run(
    engine: AsyncEngine,
    names: list[str],
    host: str,
    port: int,
    max_body: int,
    stop_on_failure: bool,
    api_key: str | None = None,
):
    import uvicorn  # only to run the server: tests build the app and drive it without uvicorn

    config = uvicorn.Config(
        build_app(engine, names, max_body, api_key),
        host=host,
        port=port,
        log_level="info",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    if stop_on_failure:
        # A dead rank takes its peers down with it: nothing is left to serve, so stop (and say why
        # now: under torchrun the launcher may end this process before it returns).
        def stop(exc: BaseException) -> None:
            log.error("expertmesh serve stopping: %s", exc)
            server.should_exit = True

        engine.on_failure = stop
    log.info("%s", describe_waiting())
    log.info("serving %s on http://%s:%d%s", names, host, port, " (API key required)" if api_key else "")
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down gracefully and re-raised it
        log.info("interrupted: server stopped")
    finally:
        engine.shutdown()
    if engine.error is not None and stop_on_failure:
        raise SystemExit(f"expertmesh serve stopped: {engine.error}")


def _under_torchrun(llm_kwargs: dict[str, Any]) -> bool:
    """Several torchrun processes (or external_launcher asked for): every process is a rank."""
    env = torchrun_env()
    backend = llm_kwargs.get("distributed_executor_backend")
    launched = env is not None and int(env["WORLD_SIZE"] or 1) > 1
    if launched and backend == "mp":
        raise SystemExit(
            "under torchrun the ranks are torchrun's processes: drop --distributed-executor-backend mp "
            "(or run `expertmesh serve` as one plain process, which spawns its ranks itself)"
        )
    return launched or backend == "external_launcher"


def _with_executor(llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Several ranks outside torchrun are served through the mp executor: spawned workers."""
    sizes = [llm_kwargs.get(f"{k}_parallel_size", 1) for k in ("tensor", "data", "pipeline")]
    if sizes == [1, 1, 1] or llm_kwargs.get("distributed_executor_backend") == "mp":
        return llm_kwargs
    return {**llm_kwargs, "distributed_executor_backend": "mp"}
