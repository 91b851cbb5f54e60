"""A synchronous façade for scripts: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import anyio
from tqdm.auto import tqdm

from jitney.core.config import EngineConfig
from jitney.core.engine import Engine
from jitney.core.request import Completion, Request, SamplingParams


class LLM:
    """Loads a model once; each `generate` call runs the engine until every prompt is done."""

    def __init__(self, model="smollm2", config: EngineConfig | None = None, tokenizer=None):
        self.engine = Engine.from_pretrained(model, config=config, tokenizer=tokenizer)

    def generate(
        self, prompts: list[str | list[int]] | str, params: SamplingParams | None = None, progress: bool = True
    ) -> list[Completion]:
        """Complete every prompt; results come back in the prompts' order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or SamplingParams()
        requests = [Request(p, params) for p in prompts]
        return anyio.run(self._run, requests, progress)

    def chat(self, conversations: list[list[dict]], params: SamplingParams | None = None,
             tools: list[dict] | None = None, progress: bool = True) -> list[Completion]:
        """Complete every conversation under the chat template (`Engine.chat`); results in their order."""
        from jitney.core.chat import prompt_ids

        params = params or SamplingParams()
        requests = [Request(prompt_ids(self.engine.tokenizer, c, tools), params) for c in conversations]
        return anyio.run(self._run, requests, progress)

    async def _run(self, requests: list[Request], progress: bool) -> list[Completion]:
        results: list[Completion | None] = [None] * len(requests)
        with tqdm(total=len(requests), disable=not progress, unit="req") as bar:
            async with self.engine as engine:
                streams = [engine.stream(r) for r in requests]  # a bad prompt raises here, before any runs

                async def one(i: int) -> None:
                    async with streams[i] as stream:
                        async for _ in stream:
                            pass
                        results[i] = stream.completion()
                    bar.update()

                async with anyio.create_task_group() as tg:
                    for i in range(len(requests)):
                        tg.start_soon(one, i)
        return results  # type: ignore[return-value]
