"""A separately packaged scheduler, installed for real and found through the `jitney` entry-point group."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import anyio
from support import random_requests, reference

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.cli import main as cli

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "shortest_prompt_first"


def test_example_package_is_discovered_and_selected_by_name(llama, tmp_path, monkeypatch, capsys):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target), str(EXAMPLE)],
        check=True, capture_output=True, timeout=300,
    )
    monkeypatch.syspath_prepend(str(target))
    importlib.invalidate_caches()

    assert cli(["plugins"]) == 0
    listing = capsys.readouterr().out
    assert "shortest-prompt-first  jitney-shortest-prompt-first 0.1.0" in listing
    assert "fifo" in listing and "prefill_first" in listing and "torch" in listing

    work = random_requests(8, llama.config.vocab_size, max_prompt=40, max_new=8, seed=4)
    refs = [reference(llama, p, n) for p, n in work]

    async def run():
        config = EngineConfig(scheduler="shortest-prompt-first", max_batch_tokens=16, num_blocks=128)
        async with Engine(llama, config=config) as engine:
            results = [None] * len(work)

            async def one(i):
                p, n = work[i]
                results[i] = await engine.generate(Request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)))

            async with anyio.create_task_group() as tg:
                for i in range(len(work)):
                    tg.start_soon(one, i)
            return type(engine.scheduler).__name__, [r.token_ids for r in results]

    name, outputs = anyio.run(run)
    assert name == "ShortestPromptFirst"
    assert outputs == refs
