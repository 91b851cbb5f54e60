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


def install(package: Path, tmp_path: Path, monkeypatch) -> None:
    """Install an example package for real (into a folder put on the path for this test)."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target), str(package)],
        check=True, capture_output=True, timeout=300,
    )
    monkeypatch.syspath_prepend(str(target))
    importlib.invalidate_caches()


def test_example_package_is_discovered_and_selected_by_name(llama, tmp_path, monkeypatch, capsys):
    install(EXAMPLE, tmp_path, monkeypatch)

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


S3FIFO = Path(__file__).resolve().parent.parent / "examples" / "s3_fifo"


def test_an_eviction_policy_package_is_discovered_and_simulated(tmp_path, monkeypatch, capsys):
    from support import tiny_llama

    from jitney.bench.profile import StepProfile
    from jitney.bench.simulate import meta_model, simulate
    from jitney.bench.traces import agentic, bursty, materialize

    install(S3FIFO, tmp_path, monkeypatch)
    assert cli(["plugins"]) == 0
    assert "s3fifo" in capsys.readouterr().out

    tiny_llama().config.save_pretrained(tmp_path / "tiny")
    model = meta_model(str(tmp_path / "tiny"))
    work = materialize(agentic(60, 4.0, seed=1) + bursty(60, 4.0, seed=2), 256)
    for a in work:  # the tiny model's context is 512 tokens
        a.prompt, a.output_tokens = a.prompt[:400], min(a.output_tokens, 100)
    profile = StepProfile(model="tiny", machine="test", coefficients=[1e-3, 2e-5, 1e-5, 1e-4, 2e-4, 1e-2],
                          fit_error=0, total_error=0, steps=0)
    rows = {p: simulate(model, work, profile, eviction=p, block_size=16, num_blocks=100) for p in ("s3fifo", "mru")}
    assert rows["s3fifo"]["refused"] == 0 and rows["s3fifo"]["prefix_hit_rate"] > 0
