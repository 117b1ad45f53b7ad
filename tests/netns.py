"""Two "nodes" on one machine: network namespaces joined by a veth pair, for multi-node tests.

Each node is a network namespace with its own loopback and one end of a veth pair, so
processes in different namespaces can only reach each other over that link, as two hosts on a
network would. torchrun runs in each with its static rendezvous (`--nnodes=2 --node-rank=K
--master-addr=<node 0's address>`); gloo is told which interface to use.

Needs root and iproute2 (`ip`); `skip_reason()` says why not where they are missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Node:
    netns: str
    ifname: str
    address: str

    def command(self, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """`argv` run inside this node, with gloo bound to the node's veth."""
        extra = {"GLOO_SOCKET_IFNAME": self.ifname, **(env or {})}
        return ["ip", "netns", "exec", self.netns, "env", *(f"{k}={v}" for k, v in extra.items()), *argv]


def skip_reason() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CI runs as root)"
    probe = f"emprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_nodes(subnet: int | None = None) -> Iterator[tuple[Node, Node]]:
    """Two namespaces `em<pid>n0/n1` joined by veth, 10.231.<subnet>.1 and .2 (/24)."""
    subnet = subnet if subnet is not None else os.getpid() % 250 + 1
    tag = f"em{os.getpid()}"
    nodes = (
        Node(f"{tag}n0", "emv0", f"10.231.{subnet}.1"),
        Node(f"{tag}n1", "emv1", f"10.231.{subnet}.2"),
    )
    try:
        for node in nodes:
            _ip("netns", "add", node.netns)
            _ip("-n", node.netns, "link", "set", "lo", "up")
        _ip(
            "link", "add", nodes[0].ifname, "netns", nodes[0].netns,
            "type", "veth", "peer", "name", nodes[1].ifname, "netns", nodes[1].netns,
        )  # fmt: skip
        for node in nodes:
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.ifname)
            _ip("-n", node.netns, "link", "set", node.ifname, "up")
        yield nodes
    finally:
        for node in nodes:  # deleting a namespace removes its end of the veth pair too
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)


def torchrun_on(
    node: Node, node_rank: int, master: Node, port: int, nproc: int, script: list[str], env=None
) -> list[str]:
    """The torchrun command line for one node of a two-node static rendezvous."""
    import sys

    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    argv = [
        *torchrun,
        "--nnodes=2",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}",
        f"--master-addr={master.address}",
        f"--master-port={port}",
        *script,
    ]
    return node.command(argv, env)


def run_on_both(
    nodes: tuple[Node, Node],
    port: int,
    nproc: int,
    script: list[str],
    env=None,
    timeout: float = 150,
    stderr: int = subprocess.PIPE,
) -> list[tuple[int, str, str | None]]:
    """`script` under torchrun on both nodes (node 0 the master): each node's (exit code, stdout,
    stderr). Each torchrun runs in its own session, so on a timeout (which raises) every rank
    under it is killed too."""
    import signal

    procs = [
        subprocess.Popen(
            torchrun_on(node, k, nodes[0], port, nproc, script, env),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        for k, node in enumerate(nodes)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return results
