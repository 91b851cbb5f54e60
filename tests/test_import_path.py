"""The repository root is the package's folder: a process started in it must still import installed packages
whose names its folders share (transformers >= 5.25 imports the `kernels` package)."""

import subprocess
import sys
from pathlib import Path

import jitney

ROOT = Path(jitney.__file__).resolve().parent

_PROBE = """
import importlib.util, sys
import jitney
spec = importlib.util.find_spec("kernels")
print(spec.origin if spec else "absent")
import transformers.modeling_utils  # (imports `kernels` where that package is installed)
"""


def test_a_process_started_in_the_repository_root_does_not_see_its_folders_as_packages():
    for argv in (["-c", _PROBE], ["-m", "jitney.cli", "--help"]):
        run = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        if argv[0] == "-c":
            assert run.stdout.strip() != str(ROOT / "kernels" / "__init__.py"), "jitney's kernels/ shadowed the package"
