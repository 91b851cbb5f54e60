"""An OpenAI-compatible HTTP server over the engine."""

from jitney.serve.app import build_app

__all__ = ["build_app"]
