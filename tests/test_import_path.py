"""The repository root is the package's folder: a process started in it (a REPL, `python -c`, a script, `python -m
pytest`) has the root on its path, and must still import installed packages whose names its folders share
(transformers >= 5.25 imports the hub's `kernels` package), whichever it imports first."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import jitney
import pytest

ROOT = Path(jitney.__file__).resolve().parent

_TRANSFORMERS_FIRST = """
from transformers import LlamaConfig, LlamaForCausalLM
import jitney
from jitney.kernels import native
print("ok", LlamaConfig.__name__)
"""

_JITNEY_FIRST = """
import jitney
from transformers import LlamaConfig
import transformers.modeling_utils
print("ok", LlamaConfig.__name__)
"""


def _in_root(*argv, stdin=None):
    run = subprocess.run([sys.executable, *argv], cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.mark.parametrize("probe", [_TRANSFORMERS_FIRST, _JITNEY_FIRST], ids=["transformers-first", "jitney-first"])
def test_python_started_in_the_root_imports_transformers_and_jitney(probe):
    assert "ok LlamaConfig" in _in_root("-c", probe)
    assert "ok LlamaConfig" in _in_root("-", stdin=probe)  # a REPL or a piped script: '' on the path


def test_no_folder_of_the_root_shadows_an_installed_package():
    """Each folder is a namespace portion: where an installed package has its name, the installed one is found."""
    for folder in sorted(p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")):
        assert not (folder / "__init__.py").exists(), f"{folder.name}/ is a regular package and would shadow {folder.name!r}"
    probe = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s and s.origin else 'namespace')"
    found = _in_root("-c", probe).strip()
    if importlib.util.find_spec("kernels") is not None:  # installed (the project's extras bring it): it wins
        assert found != "namespace" and Path(found).parent != ROOT / "kernels", found


def test_the_cli_and_pytest_run_from_the_root():
    assert "usage" in _in_root("-m", "jitney.cli", "--help")
    assert "test_the_cli_and_pytest_run_from_the_root" in _in_root(
        "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_import_path.py")
