"""C++ kernels for the CPU (`cpu_kernels.cpp`), compiled once per machine with its C++ compiler (`torch.utils.cpp_extension`,
into ``<jitney cache>/kernels``; `jitney setup` builds them ahead). Where they cannot be built, callers fall
back to torch: `available()` says which.

- `paged_decode`, `paged_prefill`: attention of decode rows and of prefill chunks, read in place through the
  block tables, with soft-capping and attention sinks where a model has them (`kernels/cpu_paged.py`).
- `pack_panels`, `panel_linear`: fp32 `x @ w.T + b` through weights packed in panels of 16 output features,
  `w` given as a list of row blocks packed as one (stacked projections) (`kernels/cpu_linear.py`).
- `rms_norm`, `rotary_`, `head_norm_`, `gated_act`: a decoder layer's elementwise work in one pass each
  (`kernels/cpu_layers.py`).
- `FusedDecoder`: a decode step of a fused model (every decoder layer, final norm, LM head) in one call
  (`kernels/cpu_layers.py`).

Each build has its own folder, named by a hash of everything that changes the binary (`build_dir()`), so
installs sharing the cache (other venvs, torch or Python versions) keep their own. A process that finds
another one building in that folder waits for it at most ``$JITNEY_KERNEL_BUILD_WAIT_S`` seconds (default
`BUILD_WAIT_S`), then uses torch's kernels.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

log = logging.getLogger("jitney")

BUILD_WAIT_S = 300.0
"""Seconds a process waits for another one's build of the kernels (about a minute) before it uses torch's."""

_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# fast-math lets the softmax's expf vectorise (glibc's vector math); only at compile time, so the library does
# not change the process's floating-point mode when it loads
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")
_LDFLAGS = ("-fopenmp",)

_module = None
_failure: Exception | None = None


def load():
    """Compile (once per `build_dir()`) and load the kernels; raises where they cannot be built."""
    global _module, _failure
    if _failure is not None:
        raise _failure
    if _module is None:
        try:
            _module = _build(build_dir())
        except Exception as exc:  # no compiler, no headers, a build elsewhere that does not end...: not retried
            _failure = exc
            log.warning("jitney's C++ CPU kernels could not be built (%s); using torch's", exc)
            raise
    return _module


def available() -> bool:
    """Whether the kernels build and load here."""
    try:
        load()
        return True
    except Exception:
        return False


def build_dir() -> Path:
    """Where the kernels are built: ``<jitney cache>/kernels/cpu-<hash>``, the hash of everything that changes
    the binary (source, torch, Python, compiler, flags, CPU), so that installs sharing the cache keep theirs."""
    import torch

    from jitney.core.models import cache_dir

    what = [
        hashlib.sha256(_SOURCE.read_bytes()).hexdigest(),
        torch.__version__,  # with its variant (+cpu, +cu121...)
        str(torch.version.cuda),
        str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")),
        sys.version,
        str(sysconfig.get_config_var("SOABI")),
        _compiler_version(),
        " ".join(_CFLAGS + _LDFLAGS),
        _cpu_tag(),  # -march=native
    ]
    key = hashlib.sha256("\n".join(what).encode()).hexdigest()
    # 16 digits: never the name of an earlier jitney's folder (10), which that jitney builds without our lock
    return cache_dir() / "kernels" / f"cpu-{key[:16]}"


def _build(build: Path):
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # torch's loader runs `ninja` from PATH: take the one pip installed
        os.environ["PATH"] = sysconfig.get_path("scripts") + os.pathsep + os.environ.get("PATH", "")
    build.mkdir(parents=True, exist_ok=True)
    with _build_lock(build, float(os.environ.get("JITNEY_KERNEL_BUILD_WAIT_S") or BUILD_WAIT_S)):
        # lists of their own: torch's loader appends its libraries to the flags it is given
        return load("jitney_cpu", sources=[str(_SOURCE)], build_directory=str(build),
                    extra_cflags=list(_CFLAGS), extra_ldflags=list(_LDFLAGS))


@contextlib.contextmanager
def _build_lock(build: Path, wait_s: float):
    """Hold the lock of the build in `build`, waiting at most `wait_s` seconds for another process's build."""
    # torch's loader takes its own `lock` file in the folder, even to load a library already built, and waits
    # for it without end; a build killed part-way (OOM, a timeout) leaves it behind for good
    torch_lock = build / "lock"
    if fcntl is None:  # no lock that the OS drops with its holder: a stale `lock` cannot be told from a live one
        _wait_until(lambda: not torch_lock.exists(), build, wait_s)
        yield
        return
    with open(build / "jitney.lock", "a") as held:  # closing it releases the lock
        _wait_until(lambda: _try_flock(held), build, wait_s)
        # Every jitney process takes this lock before torch's, and the OS drops it when its holder dies, so a
        # torch `lock` found while holding it was left by a build killed part-way: remove it. Only a torch user
        # that is not jitney could hold it live, and none has a reason to build in this folder (jitney's own,
        # named by jitney's build); one that did would build at the same time as us, as would the compiler of a
        # killed build in the seconds it outlives its Python. Both are accepted, to keep this simple.
        if torch_lock.exists():
            log.info("removing %s, left by a build that was stopped part-way", torch_lock)
            torch_lock.unlink(missing_ok=True)
        yield


def _try_flock(file) -> bool:
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _wait_until(ready, build: Path, wait_s: float) -> None:
    """Poll `ready()` until it holds; past `wait_s` seconds, raise a TimeoutError that names the folder."""
    if ready():
        return
    log.warning("waiting for another process building jitney's C++ CPU kernels in %s", build)
    deadline = time.monotonic() + wait_s
    while not ready():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"another process has been building them in {build} for over {wait_s:g} s")
        time.sleep(0.1)


def _compiler_version() -> str:
    """What the compiler torch builds with ($CXX, else c++) says of its version; empty where it does not run."""
    try:
        command = shlex.split(os.environ.get("CXX", "c++")) + ["--version"]
        return subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    except (OSError, ValueError, subprocess.SubprocessError):
        return ""


def _cpu_tag() -> str:
    """A short hash of this CPU's feature flags (Linux), else of what `platform` says about it."""
    try:
        with open("/proc/cpuinfo") as f:
            what = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        what = f"{platform.machine()} {platform.processor()}"
    return hashlib.sha1(what.encode()).hexdigest()[:10]
