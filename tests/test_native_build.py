"""Building the C++ CPU kernels: the build folder's lock and name (`kernels/native.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from jitney.kernels import native

try:
    import fcntl
except ImportError:
    fcntl = None

needs_flock = pytest.mark.skipif(fcntl is None, reason="a stale lock is told apart through fcntl.flock")

# written into the `lock` this test leaves, so that cleaning up never removes a live build's (torch's is empty)
_PLANTED = "left by test_native_build"

_HOLD_BUILD_LOCK = textwrap.dedent("""
    import time
    from jitney.kernels import native

    build = native.build_dir()
    build.mkdir(parents=True)
    with native._build_lock(build, 0):  # what a jitney process building the kernels holds
        print(build, flush=True)
        time.sleep(300)
""")

_TIMED_LOAD = textwrap.dedent("""
    import time
    import torch
    from jitney.kernels import native

    start = time.monotonic()
    print(native.available(), time.monotonic() - start)
""")


def _python(code: str, cwd, env=None, timeout: float = 180) -> subprocess.CompletedProcess:
    # run away from the checkout's root, where its `kernels` folder would pass for a top-level package
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=True)


@pytest.fixture
def build():
    """The real build folder, the kernels built in it (by `jitney setup` before the suite, else here)."""
    if not native.available():
        pytest.skip("the C++ kernels do not build here")
    return native.build_dir()


@needs_flock
def test_a_lock_left_by_a_killed_build_does_not_stop_the_next_engine(build, tmp_path):
    lock = build / "lock"
    lock.write_text(_PLANTED)  # what torch's loader leaves when its process is killed mid-build
    try:
        # torch alone waits on this file for ever: the timeout is what fails the test then
        run = _python("from jitney.kernels import native; print(native.available())", cwd=tmp_path)
        assert run.stdout.split() == ["True"], run.stderr
        assert _planted_still(lock) is False  # (a lock there now is another engine's own, live one)
    finally:
        if _planted_still(lock):
            lock.unlink()


def _planted_still(lock) -> bool:
    try:
        return lock.read_text() == _PLANTED
    except FileNotFoundError:
        return False


@needs_flock
def test_a_build_running_elsewhere_is_waited_for_within_a_bound_then_torch_is_used(tmp_path):
    env = {**os.environ, "JITNEY_HOME": str(tmp_path / "home"), "JITNEY_KERNEL_BUILD_WAIT_S": "1"}
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_BUILD_LOCK], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        folder = holder.stdout.readline().strip()
        assert folder, "the process holding the build lock did not start"
        run = _python(_TIMED_LOAD, cwd=tmp_path, env=env)
        available, seconds = run.stdout.split()
        assert available == "False"
        assert 1 <= float(seconds) < 15  # the bound, and slack for a busy machine; not a build (about a minute)
        assert folder in run.stderr  # the warning says where the other build is
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(os.name == "nt", reason="the stand-in compilers are shell scripts")
def test_the_build_folder_changes_with_torch_and_the_compiler(monkeypatch, tmp_path):
    def compiler(version: str) -> str:
        path = tmp_path / f"c++-{version}"
        path.write_text(f"#!/bin/sh\necho 'c++ {version}'\n")
        path.chmod(0o755)
        return str(path)

    monkeypatch.setenv("CXX", compiler("12.2"))
    first = native.build_dir()
    assert native.build_dir() == first
    monkeypatch.setenv("CXX", compiler("13.1"))
    other_compiler = native.build_dir()
    monkeypatch.setenv("CXX", compiler("12.2"))
    monkeypatch.setattr(torch, "__version__", "9.9.0+cpu")
    other_torch = native.build_dir()
    assert len({first, other_compiler, other_torch}) == 3
    assert first.parent == other_compiler.parent == other_torch.parent  # side by side in the jitney cache


def test_each_level_and_tuning_has_its_own_build_and_a_level_the_cpu_lacks_is_refused(monkeypatch, tmp_path):
    monkeypatch.delenv("JITNEY_KERNEL_TUNE", raising=False)
    monkeypatch.setattr(native, "cpu_flags", lambda: native.LEVELS["avx512"][1])  # an AVX-512 CPU without VNNI
    folders = set()
    for level, tune in [("native", ""), ("x86-64-v3", ""), ("avx512", ""), ("avx512", "znver3")]:
        monkeypatch.setenv("JITNEY_KERNEL_LEVEL", level)
        monkeypatch.setenv("JITNEY_KERNEL_TUNE", tune)
        assert native.target() == (level, tune)
        folders.add(native.build_dir())
    assert len(folders) == 4
    monkeypatch.setenv("JITNEY_KERNEL_LEVEL", "avx512-vnni-bf16")
    with pytest.raises(RuntimeError, match="cannot run kernels built for avx512-vnni-bf16: it lacks avx512_bf16 avx512_vnni"):
        native.target()
    # in a fresh process: never built, torch's kernels used, and the reason in the warning
    env = {**os.environ, "JITNEY_KERNEL_LEVEL": "x86-64-v9"}
    run = _python("from jitney.kernels import native; print(native.available())", cwd=tmp_path, env=env)
    assert run.stdout.split() == ["False"]
    assert "JITNEY_KERNEL_LEVEL='x86-64-v9': not one of native, x86-64-v3, avx512, avx512-vnni-bf16" in run.stderr


def test_the_level_that_runs_is_said(build):
    level, tune = native.target()
    assert native.describe() == f"built for {level}" + (f", tuned for {tune}" if tune else "")


def test_the_build_command_does_not_name_the_checkout(build):
    """Two checkouts of the same source share a build folder (named by the source's content): were the command
    to name either one's path, each would rebuild the kernels the other built, at every start."""
    ninja = (build / "build.ninja").read_text()
    assert str(build / "cpu_kernels.cpp") in ninja
    assert str(native._SOURCE) not in ninja


def test_every_part_of_the_source_is_built_from_its_copy_and_keys_the_folder(build, monkeypatch, tmp_path):
    """The kernels are one translation unit split into parts (`kernels/cpu/`): each is copied into the build folder
    at its place, and a change to any part names another folder (a stale build never loads)."""
    import shutil

    parts = [f.relative_to(native._KERNELS) for f in native._HEADERS]
    assert {"cpu/linear.h", "cpu/bf16.h", "cpu/x86/avx512_decode.h"} <= {str(p) for p in parts}
    for part in parts:
        assert (build / part).read_bytes() == (native._KERNELS / part).read_bytes()
    copy = tmp_path / "kernels"
    shutil.copytree(native._KERNELS, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(native, "_KERNELS", copy)
    monkeypatch.setattr(native, "_SOURCE", copy / native._SOURCE.name)
    monkeypatch.setattr(native, "_HEADERS", tuple(copy / part for part in parts))
    assert native.build_dir() == build  # (the same content: the same folder)
    with open(copy / "cpu" / "x86" / "avx512_decode.h", "a") as f:
        f.write("// a change\n")
    assert native.build_dir() != build
