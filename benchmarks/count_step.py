"""Instructions per decode step, counted by valgrind's callgrind (a load-independent measure of
host cost on a shared machine), split into expertmesh's compiled kernels and everything else.

The engine is built and warmed up uninstrumented; instrumentation is switched on (callgrind_control)
for `--steps` decode steps only.

    .venv/bin/python benchmarks/count_step.py --batch 1 --dtype float32 --steps 10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(args: argparse.Namespace) -> None:
    """Runs under valgrind: builds the engine, waits for instrumentation, steps, signals done."""
    import torch

    sys.path.insert(0, str(HERE))
    from make_small_moe import make_small_moe
    from profile_decode import prefilled_engine, time_steps

    torch.set_num_threads(1)
    from expertmesh.cpu import cpu_features, kernel_library

    if "avx512f" in cpu_features.cpu_flags():
        # valgrind has no AVX-512 (an -march=native build dies with SIGILL under it): count the
        # kernels' 8-lane AVX2 build instead (its own cache key: FLAGS are part of it)
        kernel_library.FLAGS = [*kernel_library.FLAGS, "-mno-avx512f"]
    engine = prefilled_engine(
        make_small_moe(args.cache_dir, args.dtype),
        args.dtype,
        args.batch,
        16,
        args.steps + 6,
        args.native_decode == "on",
    )
    time_steps(engine, 3)
    Path(args.sync, "ready").touch()
    while not Path(args.sync, "go").exists():
        time.sleep(0.05)
    time_steps(engine, args.steps)
    Path(args.sync, "done").touch()
    while not Path(args.sync, "stop").exists():
        time.sleep(0.05)


def parent(args: argparse.Namespace) -> None:
    sync = tempfile.mkdtemp(prefix="count-step-")
    out = Path(sync) / "callgrind.out"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    cmd += [sys.executable, __file__, "--child", "--sync", sync]
    cmd += [
        "--batch",
        str(args.batch),
        "--dtype",
        args.dtype,
        "--steps",
        str(args.steps),
        "--cache-dir",
        args.cache_dir,
        "--native-decode",
        args.native_decode,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait(name: str) -> None:
        while not Path(sync, name).exists():
            if proc.poll() is not None:
                raise SystemExit(f"the instrumented process exited early ({proc.returncode})")
            time.sleep(0.2)

    wait("ready")
    subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
    Path(sync, "go").touch()
    wait("done")
    subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True, capture_output=True)
    Path(sync, "stop").touch()
    proc.wait()
    report(sorted(Path(sync).glob("callgrind.out*")), args)


def report(files: list[Path], args: argparse.Namespace) -> None:
    """Total instructions per step, and the part spent in our kernel library (by object file)."""
    total = ours = 0
    for f in files:
        text = subprocess.run(
            ["callgrind_annotate", "--inclusive=no", "--threshold=100", str(f)],
            capture_output=True,
            text=True,
        ).stdout
        for line in text.splitlines():
            parts = line.split()
            if not parts or not parts[0].replace(",", "").isdigit():
                continue
            n = int(parts[0].replace(",", ""))
            if "PROGRAM TOTALS" in line:
                total += n
            elif "libexpertmesh_cpu" in line:
                ours += n
    s = args.steps
    print(
        f"batch {args.batch} {args.dtype} native {args.native_decode}: "
        f"{total / s / 1e6:.1f} M instructions a step, "
        f"{ours / s / 1e6:.1f} M in our kernels, {(total - ours) / s / 1e6:.1f} M elsewhere (host)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cache-dir", default="/tmp/expertmesh-bench")
    ap.add_argument("--native-decode", default="on", choices=["on", "off"], help="EngineArgs.native_decode")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sync", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    child(args) if args.child else parent(args)


if __name__ == "__main__":
    main()
