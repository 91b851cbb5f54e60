"""Peers for `jitney bench`'s tests that crash as llama.cpp can: in a module of their own on the tests' path,
because a peer runs in a spawned child that imports its function by name (pytest's importlib mode gives test
modules names that the child cannot import)."""

from __future__ import annotations

import os
import signal


def segfaults(work, threads):
    """Kill its own process with SIGSEGV, as a crash in native code does."""
    os.kill(os.getpid(), signal.SIGSEGV)


def segfaults_when_repacked(work, threads, repack=True):
    """Crash as `segfaults` with `repack`, else give 7s for every request in half a second."""
    if repack:
        segfaults(work, threads)
    return [[7] * n for _, n in work], 0.5
