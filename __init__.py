"""jitney: an async-native continuous-batching inference engine for Hugging Face causal language models."""

import os as _os
import sys as _sys

# The repository root is this package's folder (`package-dir = {"jitney" = "."}`). A process started in it
# (`python -m jitney.cli`, `python -c`) has it on its path, and so do Ray's workers (they get the driver's working
# directory): its folders would then shadow installed packages of the same name (transformers >= 5.25 imports
# the `kernels` package). jitney itself is found through its install, so the folder leaves the path.
_root = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]

from jitney.core.config import EngineConfig
from jitney.core.engine import Engine
from jitney.core.stream import TokenStream
from jitney.core.llm import LLM
from jitney.core.request import Completion, Priority, Request, RequestError, Sample, SamplingParams, Token

__all__ = [
    "LLM", "Completion", "Engine", "EngineConfig", "Priority", "Request", "RequestError", "Sample", "SamplingParams",
    "Token", "TokenStream",
]

