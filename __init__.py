"""jitney: an async-native continuous-batching inference engine for Hugging Face causal language models."""

from jitney.core.config import EngineConfig
from jitney.core.engine import Engine
from jitney.core.grammar import Grammar
from jitney.core.stream import TokenStream
from jitney.core.llm import LLM
from jitney.core.request import Completion, Priority, Request, RequestError, Sample, SamplingParams, Token

__all__ = [
    "LLM", "Completion", "Engine", "EngineConfig", "Grammar", "Priority", "Request", "RequestError", "Sample", "SamplingParams",
    "Token", "TokenStream",
]

