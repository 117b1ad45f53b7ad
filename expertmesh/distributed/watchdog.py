"""No silent hang: a heartbeat over the rendezvous store, and a thread that ends a stuck rank.

Every rank of a multi-rank run publishes, once a `interval` seconds, a small record under
`expertmesh-watchdog/<rank>` in torch.distributed's TCPStore: a beat counter, what it is doing,
the collective it is waiting in, and how many collectives it has entered on each group. While a
rank waits (in a collective of `distributed/group.py`, or in `barrier` below), its watchdog reads
the records of the ranks it waits for, and ends the process when

- one of them has exited (it raised, or its script ended) - at once;
- one of them has published no beat for `timeout` seconds (frozen: SIGSTOP, a dead host);
- the wait itself has lasted `timeout` seconds (a peer alive but not joining: stuck elsewhere).

The message names the rank, and what this rank was waiting for; it is also written to the store
(`expertmesh-watchdog/abort`), where every other rank's watchdog reads it and ends too. The main
thread, blocked inside gloo or NCCL, cannot be interrupted, so the process exits with
`os._exit(WATCHDOG_EXIT_CODE)` after logging. Collective timeouts of the process groups are set
above `timeout` as a backstop (launcher.py). One watchdog per process (`install`, `current`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("expertmesh")
DEFAULT_TIMEOUT_S = 60.0
WATCHDOG_EXIT_CODE = 70
PREFIX = "expertmesh-watchdog/"
_HOST = socket.gethostname()


class Wait:
    """One wait of the main thread: for `peers`, in `what`, the `seq`-th collective on `group`."""

    def __init__(self, what: str, group: str | None, seq: int, peers: tuple[int, ...], patient: bool) -> None:
        self.what, self.group, self.seq, self.peers = what, group, seq, peers
        self.patient = patient  # a barrier: slow but alive peers are waited for
        self.start = time.monotonic()


class Watchdog:
    def __init__(
        self, store: Any, rank: int, world_size: int, timeout_s: float, interval_s: float | None = None
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"distributed_timeout_seconds={timeout_s!r} must be > 0")
        self.store, self.rank, self.world_size, self.timeout = store, rank, world_size, float(timeout_s)
        self.interval = interval_s or min(1.0, self.timeout / 5)
        self.on_fire: list[Callable[[str], None]] = []  # e.g. an mp worker tells its parent
        self.doing = "starting"
        self.seqs: dict[str, int] = {}  # group key -> collectives entered on it
        self.wait: Wait | None = None
        self.exited: str | None = None
        self._beat = 0
        self._barriers = 0
        self._frozen: dict | None = None  # the record of a peer found frozen (ended with us, if local)
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (beat, monotonic time it changed)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the store client is used by this thread and the main one
        self._publish()
        self._thread = threading.Thread(target=self._run, name="expertmesh-watchdog", daemon=True)
        self._thread.start()

    @property
    def deadline(self) -> float:
        return _deadline(self.timeout, self.interval)

    # ---- main thread --------------------------------------------------------------------------
    @contextlib.contextmanager
    def waiting(
        self, what: str, peers: tuple[int, ...], group: str | None = None, patient: bool = False
    ) -> Iterator[None]:
        seq = 0
        if group is not None:
            seq = self.seqs[group] = self.seqs.get(group, 0) + 1
        self.wait = Wait(what, group, seq, tuple(p for p in peers if p != self.rank), patient)
        try:
            yield
        except RuntimeError as exc:  # gloo/NCCL says only "connection closed": say who and why
            raise RuntimeError(f"rank {self.rank}: {what} failed ({exc}); {self._diagnose()}") from exc
        finally:
            self.wait = None

    def barrier(self, what: str) -> None:
        """Wait until every rank got here; slow ranks are waited for as long as they beat."""
        self._barriers += 1  # every rank passes its barriers in the same order
        key = f"{PREFIX}barrier/{self._barriers}"
        with self.waiting(f"the start-up barrier '{what}'", tuple(range(self.world_size)), patient=True):
            with self._lock:
                self.store.add(key, 1)
            while True:
                with self._lock:
                    count = int(self.store.add(key, 0))
                if count >= self.world_size:
                    return
                time.sleep(min(0.05, self.interval))

    def close(self, reason: str = "its script ended") -> None:
        """This rank leaves: peers that still wait for it are told why, not left to time out."""
        if self._stop.is_set():
            return
        self.exited = reason
        self._stop.set()
        with contextlib.suppress(Exception):
            self._publish()
        if threading.current_thread() is not self._thread:
            # Let the thread finish its store call: a daemon thread still inside one when the
            # interpreter finalizes is ended by a forced unwind through C++ frames, which aborts
            # the process ("terminate called without an active exception") after a clean run.
            self._thread.join(timeout=5.0)

    # ---- watchdog thread ----------------------------------------------------------------------
    def _run(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                cause = self._abort_reason() or self._check()
                last_ok = time.monotonic()
            except Exception as exc:  # the store is hosted by rank 0 or the launcher: gone?
                cause = None
                if time.monotonic() - last_ok > self.deadline:
                    cause = f"the rendezvous store has been unreachable for {self.timeout:g} s ({exc})"
            if cause:
                self._fire(cause)

    def _publish(self) -> None:
        self._beat += 1
        wait = self.wait
        record = {
            "beat": self._beat,
            "host": _HOST,
            "pid": os.getpid(),
            "doing": self.doing,
            "wait": None if wait is None else [wait.what, round(time.monotonic() - wait.start, 1)],
            "seqs": dict(self.seqs),
            "exited": self.exited,
        }
        with self._lock:
            self.store.set(f"{PREFIX}{self.rank}", json.dumps(record))

    def _records(self, ranks: tuple[int, ...]) -> dict[int, dict]:
        out = {}
        with self._lock:
            for r in ranks:
                key = f"{PREFIX}{r}"
                if self.store.check([key]):
                    out[r] = json.loads(self.store.get(key))
        return out

    def _abort_reason(self) -> str | None:
        key = f"{PREFIX}abort"
        with self._lock:
            if not self.store.check([key]):
                return None
            return f"another rank ended the run: {self.store.get(key).decode()}"

    def _check(self) -> str | None:
        wait = self.wait
        if wait is None:
            self._seen.clear()
            return None
        now, waited = time.monotonic(), time.monotonic() - wait.start
        records = self._records(wait.peers)
        silent: dict[int, float] = {}  # peer -> seconds its beat has not moved (0: it just did)
        for peer in wait.peers:
            rec = records.get(peer)
            if rec is None:
                continue
            if rec["exited"] and waited >= self.interval:  # not a peer that left as we finished
                why = rec["exited"]
                return f"rank {peer} exited ({why}); rank {self.rank} was waiting for it in {wait.what}"
            beat, since = self._seen.get(peer, (None, now))
            if beat != rec["beat"]:
                self._seen[peer], silent[peer] = (rec["beat"], now), 0.0
            else:
                silent[peer] = now - since
            if silent[peer] >= self.deadline:
                return self._frozen_peer(peer, rec, silent[peer], wait)
        if waited < self.deadline:
            return None
        if wait.patient:  # every peer is alive: say so now and then, never give up on it
            if int(waited) % max(1, int(self.timeout)) < self.interval:
                log.info(
                    "rank %d still waiting in %s (%.0f s); peers are alive", self.rank, wait.what, waited
                )
            return None
        behind = [
            p
            for p in wait.peers
            if wait.group and records.get(p, {}).get("seqs", {}).get(wait.group, 0) < wait.seq
        ]
        for peer in behind or list(silent):  # a silent one is frozen, whatever it last showed
            quiet = silent.get(peer, 0.0)
            if quiet >= 1.5 * self.interval:  # it missed a beat: more than jitter
                return self._frozen_peer(peer, records[peer], quiet, wait)
            if quiet > 0:
                return None  # one more look before blaming a live peer
        if behind:
            who = "; ".join(f"rank {p} is {_describe(records[p])}" for p in behind if p in records)
            return (
                f"rank {self.rank} waited {waited:.1f} s in {wait.what} (collective #{wait.seq} on "
                f"{wait.group}) for rank(s) {behind}, which never joined it ({who})"
            )
        who = "; ".join(f"rank {p} is {_describe(r)}" for p, r in records.items())
        return f"rank {self.rank} waited {waited:.0f} s in {wait.what} without an answer ({who})"

    def _frozen_peer(self, peer: int, rec: dict, silent: float, wait: Wait) -> str:
        self._frozen = rec
        return (
            f"rank {peer} stopped responding: no heartbeat for {silent:.1f} s (its last one: "
            f"{_describe(rec)}); rank {self.rank} was waiting for it in {wait.what}"
        )

    def _diagnose(self) -> str:
        """After a failed collective: which waited-for peer exited or went silent."""
        wait = self.wait
        peers = wait.peers if wait else tuple(r for r in range(self.world_size) if r != self.rank)
        try:
            first = self._records(peers)
            time.sleep(2 * self.interval)  # a peer that died has stopped beating by now
            second = self._records(peers)
        except Exception as exc:
            return f"the rendezvous store is unreachable too ({exc})"
        for p in peers:
            if p in second and second[p]["exited"]:
                return f"rank {p} exited: {second[p]['exited']}"
        silent = [p for p in peers if p in first and p in second and first[p]["beat"] == second[p]["beat"]]
        if silent:
            return f"rank(s) {silent} stopped beating (died or frozen; last: {_describe(second[silent[0]])})"
        return "every peer is still alive"

    def _fire(self, cause: str) -> None:
        message = (
            f"expertmesh watchdog, rank {self.rank}: {cause}. Ending this rank (distributed_timeout_seconds="
            f"{self.timeout:g} sets how long a rank may stay silent)"
        )
        with contextlib.suppress(Exception), self._lock:
            if not self.store.check([f"{PREFIX}abort"]):
                self.store.set(f"{PREFIX}abort", f"rank {self.rank}: {cause}")
        if log.handlers or logging.getLogger().handlers:
            log.error(message)
        else:
            print(message, file=sys.stderr, flush=True)
        for callback in self.on_fire:
            with contextlib.suppress(Exception):
                callback(message)
        frozen = self._frozen
        if frozen is not None and frozen.get("host") == _HOST:
            # A stopped process cannot end itself (SIGTERM waits for SIGCONT): launchers then wait
            # their whole grace period. It shares this host, so end it here.
            print(
                f"expertmesh watchdog: ending the frozen rank's process (pid {frozen['pid']})",
                file=sys.stderr,
            )
            with contextlib.suppress(OSError):
                os.kill(int(frozen["pid"]), signal.SIGKILL)
        os._exit(WATCHDOG_EXIT_CODE)


def _deadline(timeout: float, interval: float) -> float:
    """When to act so the process is gone within `timeout` of a silence: a peer is first read
    up to an interval after a wait starts, a check runs once an interval, and ending takes a moment."""
    return max(timeout - 3 * min(interval, timeout / 5), timeout / 5)


def _describe(record: dict) -> str:
    if record.get("wait"):
        what, seconds = record["wait"]
        return f"waiting in {what} for {seconds:.0f} s"
    return f"not in a collective ({record.get('doing')})"


class HeartbeatMonitor:
    """Reads the ranks' records from outside (the mp executor's parent, which hosts the store)."""

    def __init__(self, store: Any, world_size: int, timeout_s: float) -> None:
        self.store, self.world_size, self.timeout = store, world_size, float(timeout_s)
        self._seen: dict[int, tuple[int, float]] = {}

    def stalled(self) -> tuple[int, str] | None:
        """(rank, what it was doing) of a rank whose beat has not moved for `timeout` seconds."""
        now = time.monotonic()
        for rank in range(self.world_size):
            key = f"{PREFIX}{rank}"
            if not self.store.check([key]):
                continue  # still starting: its watchdog is not up yet
            rec = json.loads(self.store.get(key))
            beat, since = self._seen.get(rank, (None, now))
            if beat != rec["beat"]:
                self._seen[rank] = (rec["beat"], now)
            elif now - since >= _deadline(self.timeout, 1.0) and not rec["exited"]:
                return rank, f"no heartbeat for {now - since:.0f} s; it was {_describe(rec)}"
        return None


_current: Watchdog | None = None


def install(watchdog: Watchdog) -> Watchdog:
    global _current
    if _current is not None:
        _current.close("replaced by a new engine in the same process")
    _current = watchdog
    atexit.register(watchdog.close)
    previous = sys.excepthook

    def excepthook(kind: type, value: BaseException, tb: Any) -> None:
        # Peers waiting for this rank then read why it left, instead of a bare "connection closed".
        watchdog.close(f"it raised {kind.__name__}: {value}"[:500])
        previous(kind, value, tb)
        # Leave without finalizing the interpreter: the process groups' destructors (gloo's
        # threads, the store's) racing a peer that leaves at the same moment once ended a rank in
        # SIGABRT after its traceback. The exit code is Python's own for an uncaught exception.
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(1)

    sys.excepthook = excepthook
    return watchdog


def current() -> Watchdog | None:
    return _current


def waiting(what: str, peers: tuple[int, ...], group: str | None = None):
    """The current watchdog's `waiting`, or nothing at all in a one-rank run."""
    return _current.waiting(what, peers, group) if _current is not None else contextlib.nullcontext()


def set_doing(text: str) -> None:
    if _current is not None:
        _current.doing = text
