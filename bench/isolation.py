"""Peers of `jitney bench` (other engines: llama.cpp) each run in a child process of their own, so that a crash
in a peer's native code, a segmentation fault in llama.cpp, costs that peer's row and not the rows already
measured, nor the table."""

from __future__ import annotations

import faulthandler
import functools
import multiprocessing
import resource
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from jitney.bench.workloads import Workload


class PeerFailed(RuntimeError):
    """A peer's child process ended without a result. `signal`: the name of the signal that killed it (e.g.
    "SIGSEGV"), None when it exited with a nonzero status or its run raised; `reason`: what happened, in words."""

    def __init__(self, reason: str, signal: str | None = None):
        super().__init__(reason)
        self.reason, self.signal = reason, signal


@dataclass(frozen=True)
class Peer:
    """A peer mode of `jitney bench`. `run(work, threads, **option)` returns (the tokens of each request, seconds
    from the first request to the last token); it runs in a child process, so it is a module-level function.

    `options`: (note, keyword arguments of `run`) tried in order, the next only when the child was killed by a
    signal: a way of running the peer that crashes on some machines, then a safer one (llama.cpp's repacked
    weights, then its plain ones). The note of the one that ran goes into the row."""

    run: Callable[..., tuple[list[list[int]], float]]
    options: tuple[tuple[str, dict], ...] = (("", {}),)


@dataclass
class PeerStats:
    """What a peer's run reports besides its tokens and seconds."""

    peak_rss_mib: int  # the child's own, not this process's
    note: str = ""  # which of the peer's options ran, and why the ones before it did not


def run_peer(peer: Peer, work: Workload, threads: int) -> tuple[list[list[int]], PeerStats, float]:
    """Run `peer` on `work` in a child process, falling back through its options while children crash:
    (tokens of each request, `PeerStats`, seconds). Raises `PeerFailed` when no option gave a result."""
    crashed: list[str] = []  # "<note> run killed by <signal>", one per option that crashed
    for i, (note, option) in enumerate(peer.options):
        try:
            (tokens, seconds), rss = run_in_child(functools.partial(peer.run, **option), work, threads)
        except PeerFailed as failed:
            if failed.signal is None or i == len(peer.options) - 1:
                last = f"{note} run {failed.reason}" if crashed else failed.reason
                raise PeerFailed("; ".join([*crashed, last]), failed.signal) from None
            crashed.append(f"{note} run killed by {failed.signal}")
            continue
        return tokens, PeerStats(rss, f"{note} ({'; '.join(crashed)})" if crashed else note), seconds
    raise ValueError("a peer needs at least one option")


def run_in_child(fn: Callable, *args) -> tuple[object, int]:
    """`fn(*args)` in a fresh process: (what it returned, the child's peak RSS in MiB). Raises `PeerFailed` when
    the child is killed, exits without a result, or `fn` raises (its traceback printed by the child).

    Spawned, not forked: the child inherits none of this process's threads (torch's OpenMP team, the engine's)
    nor their locks; `fn` and `args` travel by pickle, and the child imports the program's main module again (a
    script calling this keeps its work under `if __name__ == "__main__":`)."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, fn, args), daemon=True)
    child.start()
    send.close()  # (this process's end: the pipe then reads as closed once the child is gone)
    try:
        message = receive.recv()
    except EOFError:
        message = None
    finally:
        receive.close()
        child.join()
    if message is None:
        if child.exitcode is not None and child.exitcode < 0:
            name, why = _signal_name(-child.exitcode)
            raise PeerFailed(f"killed by {name} ({why})", name)
        raise PeerFailed(f"exited with status {child.exitcode} without a result")
    ok, value = message
    if not ok:
        raise PeerFailed(value)
    return value


def _child(send, fn: Callable, args: tuple) -> None:
    faulthandler.enable()  # (a crash in native code then prints the Python stack it happened under)
    try:
        value = fn(*args)
    except BaseException as exc:
        traceback.print_exc()
        send.send((False, f"{type(exc).__name__}: {exc}"))
    else:
        send.send((True, (value, _peak_rss_mib())))


def _peak_rss_mib() -> int:
    # Linux's ru_maxrss starts a spawned child at its parent's peak (kept across fork and exec); VmHWM is the
    # high-water mark of this process's own memory since its exec.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _signal_name(number: int) -> tuple[str, str]:
    try:
        return signal.Signals(number).name, signal.strsignal(number) or ""
    except ValueError:
        return f"signal {number}", "unknown signal"
