"""jitney: an async-native continuous-batching inference engine for Hugging Face causal language models."""

from jitney.core.config import EngineConfig
from jitney.core.engine import Engine, TokenStream
from jitney.core.llm import LLM
from jitney.core.request import Completion, Request, RequestError, SamplingParams, Token

__all__ = ["Completion", "Engine", "EngineConfig", "LLM", "Request", "RequestError", "SamplingParams", "Token", "TokenStream"]

