"""C++ kernels for the CPU (`cpu_kernels.cpp`), compiled once per machine with its C++ compiler (`torch.utils.cpp_extension`,
into ``<jitney cache>/kernels``; `jitney setup` builds them ahead). Where they cannot be built, callers fall
back to torch: `available()` says which.

- `paged_decode`, `paged_prefill`: attention of decode rows and of prefill chunks, read in place through the
  block tables (`kernels/cpu_paged.py`).
- `pack_panels`, `panel_linear`: fp32 `x @ w.T + b` through weights packed in panels of 16 output features,
  `w` given as a list of row blocks packed as one (stacked projections) (`kernels/cpu_linear.py`).
- `rms_norm`, `rotary_`, `silu_mul`: a decoder layer's elementwise work in one pass each
  (`kernels/cpu_layers.py`).
- `FusedDecoder`: a decode step of a fused model (every decoder layer, final norm, LM head) in one call
  (`kernels/cpu_layers.py`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sysconfig
from pathlib import Path

log = logging.getLogger("jitney")

_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")

_module = None
_failure: Exception | None = None


def load():
    """Compile (once per machine and source) and load the kernels; raises where they cannot be built."""
    global _module, _failure
    if _failure is not None:
        raise _failure
    if _module is None:
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # torch's loader runs `ninja` from PATH: take the one pip installed
            os.environ["PATH"] = sysconfig.get_path("scripts") + os.pathsep + os.environ.get("PATH", "")

        from jitney.core.models import cache_dir

        build = cache_dir() / "kernels" / f"cpu-{_cpu_tag()}"  # built with -march=native: one per CPU kind
        build.mkdir(parents=True, exist_ok=True)
        try:
            _module = load(
                "jitney_cpu", sources=[str(_SOURCE)],
                build_directory=str(build),
                # fast-math lets the softmax's expf vectorise (glibc's vector math); only at compile time, so
                # the library does not change the process's floating-point mode when it loads
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], extra_ldflags=["-fopenmp"],
            )
        except Exception as exc:  # no compiler, no headers, ...: not retried in this process
            _failure = exc
            log.warning("jitney's C++ CPU kernels could not be built (%s); using torch's", exc)
            raise
    return _module


def _cpu_tag() -> str:
    """A short hash of this CPU's feature flags (Linux), else of what `platform` says about it."""
    try:
        with open("/proc/cpuinfo") as f:
            what = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        what = f"{platform.machine()} {platform.processor()}"
    return hashlib.sha1(what.encode()).hexdigest()[:10]


def available() -> bool:
    """Whether the kernels build and load here."""
    try:
        load()
        return True
    except Exception:
        return False


