"""C++ kernels for the CPU (`cpu_kernels.cpp` and its parts in `cpu/`), compiled once per machine with its C++
compiler (`torch.utils.cpp_extension`, into ``<jitney cache>/kernels``; `jitney setup` builds them ahead). Where
they cannot be built, callers fall back to torch: `available()` says which.

- `paged_decode`, `paged_prefill`: attention of decode rows and of prefill chunks, read in place through the
  block tables, with soft-capping and attention sinks where a model has them (`kernels/cpu_paged.py`).
- `pack_panels`, `panel_linear`: fp32 `x @ w.T + b` through weights packed in panels of 16 output features,
  `w` given as a list of row blocks packed as one (stacked projections) (`kernels/cpu_linear.py`).
- `rms_norm`, `rotary_`, `head_norm_`, `gated_act`: a decoder layer's elementwise work in one pass each
  (`kernels/cpu_layers.py`).
- `FusedDecoder`: a decode step of a fused model (every decoder layer, final norm, LM head) in one call
  (`kernels/cpu_layers.py`).

**Instruction-set levels.** By default the kernels are built for the CPU that runs them (`-march=native`).
``$JITNEY_KERNEL_LEVEL`` builds them for another level this CPU can run (`LEVELS`: x86-64-v3, avx512,
avx512-vnni-bf16), and ``$JITNEY_KERNEL_TUNE`` with another tuning (`-mtune=`, e.g. sapphirerapids, znver3):
how the suite covers CPUs it does not run on (`python -m jitney.bench.levels`). A level whose instructions this
CPU lacks is never built or run: `load()` refuses it (and callers use torch's kernels). Which level runs is
logged once, when the kernels load.

**Numerical contract.** The kernels are built without `-ffast-math` and with `-ffp-contract=off`: the compiler
neither reorders a sum nor fuses a multiply and an add of its own accord; the source fuses them where it means to
(`madd`, FMA where the CPU has it). So where two paths run the same source on the same values (a bf16 cache
against an fp32 cache of the rounded values, a row alone against the row in a batch, a tile of 5 rows against one
of 12) they give the same bits at every level and tuning; against torch's reference, and from one level to another
(8- or 16-wide vectors sum in another order), they agree within the bounds the tests state. exp is the file's own
polynomial (`vexp`), not libm's.

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

_KERNELS = Path(__file__).parent
_SOURCE = _KERNELS / "cpu_kernels.cpp"
_HEADERS = tuple(sorted((_KERNELS / "cpu").rglob("*.h")))
"""The parts the source includes (`kernels/cpu/`, by operation; `cpu/x86/`), copied beside it for the build."""
# Neither flag changes a value: no errno to set lets sqrt inline, no traps lets loops with branches vectorise.
_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
_LDFLAGS = ("-fopenmp",)

_V3 = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
LEVELS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "native": (("-march=native",), frozenset()),
    "x86-64-v3": (("-march=x86-64-v3",), _V3),
    "avx512": (("-march=x86-64-v4",), _V4),
    "avx512-vnni-bf16": (("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"), _V4 | {"avx512_vnni", "avx512_bf16"}),
}
"""Each level: its compiler flags, and the CPU features (as /proc/cpuinfo names them) it needs to run."""

_module = None
_failure: Exception | None = None


def load():
    """Compile (once per `build_dir()`) and load the kernels; raises where they cannot be built."""
    global _module, _failure
    if _failure is not None:
        raise _failure
    if _module is None:
        try:
            level, tune = target()
            _module = _build(build_dir())
            log.info("jitney's C++ CPU kernels: level %s%s", level, f", tuned for {tune}" if tune else "")
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


def describe() -> str:
    """Which kernels run, in words: the level and tuning built for, or why torch's are used instead."""
    try:
        load()
    except Exception as exc:
        return f"not available ({exc}); torch's are used"
    level, tune = target()
    return f"built for {level}" + (f", tuned for {tune}" if tune else "")


def target() -> tuple[str, str]:
    """The level and tuning to build for (``$JITNEY_KERNEL_LEVEL``, ``$JITNEY_KERNEL_TUNE``); raises where the level is
    unknown or needs instructions this CPU lacks."""
    level = os.environ.get("JITNEY_KERNEL_LEVEL") or "native"
    tune = os.environ.get("JITNEY_KERNEL_TUNE") or ""
    if level not in LEVELS:
        raise ValueError(f"JITNEY_KERNEL_LEVEL={level!r}: not one of {', '.join(LEVELS)}")
    missing = lacking(level)
    if missing:
        raise RuntimeError(f"this CPU cannot run kernels built for {level}: it lacks {' '.join(missing)}")
    return level, tune


def lacking(level: str) -> list[str]:
    """The CPU features `level` needs that this CPU lacks (none: it can run that level's kernels)."""
    return sorted(LEVELS[level][1] - cpu_flags())


def cpu_flags() -> frozenset[str]:
    """This CPU's features as /proc/cpuinfo names them (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return frozenset()


def _flags() -> tuple[str, ...]:
    level, tune = target()
    return _CFLAGS + LEVELS[level][0] + ((f"-mtune={tune}",) if tune else ())


def build_dir() -> Path:
    """Where the kernels are built: ``<jitney cache>/kernels/cpu-<hash>``, the hash of everything that changes
    the binary (source, torch, Python, compiler, flags, CPU), so that installs sharing the cache keep theirs."""
    import torch

    from jitney.core.models import cache_dir

    what = [
        *(hashlib.sha256(str(f.relative_to(_KERNELS)).encode() + f.read_bytes()).hexdigest()
          for f in (_SOURCE, *_HEADERS)),  # (each part by its place and content)
        torch.__version__,  # with its variant (+cpu, +cu121...)
        str(torch.version.cuda),
        str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")),
        sys.version,
        str(sysconfig.get_config_var("SOABI")),
        _compiler_version(),
        " ".join(_flags() + _LDFLAGS),
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
        # Compiled from a copy inside the folder: the folder is named by the source's content, and torch's
        # loader rebuilds whenever the command changes, so two checkouts of the same source would otherwise
        # rebuild each other's kernels at every start (their paths differ).
        for file in (*_HEADERS, _SOURCE):
            copy, text = build / file.relative_to(_KERNELS), file.read_bytes()
            if not copy.exists() or copy.read_bytes() != text:
                copy.parent.mkdir(parents=True, exist_ok=True)
                copy.write_bytes(text)
        source = build / _SOURCE.name
        # lists of their own: torch's loader appends its libraries to the flags it is given
        return load("jitney_cpu", sources=[str(source)], build_directory=str(build),
                    extra_cflags=list(_flags()), extra_ldflags=list(_LDFLAGS))


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
    what = " ".join(sorted(cpu_flags())) or f"{platform.machine()} {platform.processor()}"
    return hashlib.sha1(what.encode()).hexdigest()[:10]
