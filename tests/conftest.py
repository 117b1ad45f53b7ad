import json
import logging
import os

import pytest
from checkpoints import FAMILIES, make_checkpoint, train_tokenizer
from real_checkpoints import Sizes, build, published, shrink

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_runtest_logreport(report) -> None:
    """EXPERTMESH_FAILURE_LOG=path: each failure appended as it happens, so a run cut short by a time
    limit (tools/cuda_check.sh on a lent GPU) still says what failed. Written by the controller only
    under pytest-xdist (its workers report to it)."""
    path = os.environ.get("EXPERTMESH_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")


@pytest.fixture
def engine_log(caplog):
    """The expertmesh logger's records at INFO (it does not propagate to the root logger caplog
    watches once configured)."""
    log = logging.getLogger("expertmesh")
    log.addHandler(caplog.handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        yield caplog
    finally:
        log.removeHandler(caplog.handler)
        log.setLevel(level)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tokenizer"))
    train_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """checkpoint(family, **config_overrides) -> directory, made once per distinct request."""
    made: dict[tuple, str] = {}

    def make(family: str, seed: int = 0, **overrides) -> str:
        key = (family, seed, tuple(sorted(overrides.items())))
        if key not in made:
            assert family in FAMILIES, family
            path = str(tmp_path_factory.mktemp(family))
            made[key] = make_checkpoint(family, path, tokenizer_dir, seed, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def real_checkpoint(tmp_path_factory, tokenizer_dir):
    """real_checkpoint(name or published dict, seed=0, sizes=Sizes(), original_format=True,
    **overrides) -> directory of a tiny random checkpoint built from tests/real_configs/<name>.json
    (or the dict), shrunk to `sizes` (real_checkpoints.shrink) with `overrides` applied last, saved
    with the hub's tensor names (or transformers' in-memory ones); made once per distinct request."""
    made: dict[str, str] = {}

    def make(
        source: str | dict,
        seed: int = 0,
        sizes: Sizes | None = None,
        original_format: bool = True,
        **overrides,
    ) -> str:
        config = shrink(
            published(source) if isinstance(source, str) else source, sizes or Sizes(), **overrides
        )
        key = json.dumps([config, seed, original_format], sort_keys=True)
        if key not in made:
            name = config["architectures"][0]
            path = str(tmp_path_factory.mktemp(name))
            made[key] = build(config, path, tokenizer_dir, seed, original_format)
        return made[key]

    return make


@pytest.fixture(scope="session")
def kernels():
    """expertmesh's compiled CPU kernels (this machine image has a C compiler: a build failure fails)."""
    from expect import no_kernels

    from expertmesh.cpu import cpu_kernels

    k = cpu_kernels.load()
    if k is None:
        no_kernels()  # fails naming the compiler error; skips only under EXPERTMESH_DISABLE_CPU_KERNELS
    return k


@pytest.fixture(scope="session")
def generic_kernels(tmp_path_factory):
    """The kernels built with -mno-avx512f: the 8-lane (AVX2) tiles and widening bf16 that CPUs
    without AVX-512 take, built once for the tests that check that path on any x86 CPU."""
    import platform

    from expertmesh.cpu import cpu_kernels, kernel_library

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("-mno-avx512f is an x86 flag")
    compiler = kernel_library.compiler()
    assert compiler is not None, "this machine image has a C compiler"
    return cpu_kernels.build(tmp_path_factory.mktemp("generic") / "generic.so", compiler, ("-mno-avx512f",))
