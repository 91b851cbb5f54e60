"""`python -m jitney.bench.levels`: the C++ kernels built for each instruction-set level and tuning this CPU can run,
and the kernel, fused-decoder and start-up-check tests run against each build — how the suite covers CPUs it does
not run on (`kernels/native.py`: `LEVELS`, ``$JITNEY_KERNEL_LEVEL``, ``$JITNEY_KERNEL_TUNE``).

`make test` runs one level besides native (`--targets x86-64-v3 --tests quick`); `make nightly` the whole matrix,
with the start-up check's differences for SmolLM2 per format (`--margins`), and prints the table that
docs/reliability.md keeps. A level this CPU lacks is reported as not run, never built."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from jitney.kernels import native

ROOT = Path(__file__).resolve().parent.parent

TARGETS = [("native", ""), ("x86-64-v3", ""), ("avx512", ""), ("avx512-vnni-bf16", ""),
           ("avx512", "sapphirerapids"), ("avx512", "znver3")]
"""(level, tuning) pairs of the whole matrix: every level, and two tunings any AVX-512 CPU runs (an Intel server's,
which prefers 256-bit vectors where it vectorises loops itself, and a Zen part's)."""

TESTS = {
    "quick": ["tests/test_native.py", "tests/test_attention.py", "tests/test_cpu_layers.py", "tests/test_model_check.py"],
    "full": ["tests/test_native.py", "tests/test_attention.py", "tests/test_cpu_layers.py", "tests/test_model_check.py",
             "tests/test_kv_cache_dtype.py", "tests/test_kv_int8.py", "tests/test_int8.py", "tests/test_head_screen.py",
             "tests/test_batch_invariance.py"],
}
"""The tests each build runs: the kernels', the fused decoder's and the start-up check's (`quick`), plus the
cache formats', int8 weights', the LM head screen's and batch invariance (`full`)."""

MARGIN_FORMATS = [{}, {"weights": "int8"}, {"weights": "w8a8"}, {"weights": "bf16"}, {"kv_cache_dtype": "bf16"},
                  {"kv_cache_dtype": "int8"}, {"weights": "w8a8", "kv_cache_dtype": "bf16"}, {"compute": "bf16"},
                  {"compute": "bf16", "kv_cache_dtype": "bf16"}]


def margins(model: str = "smollm2") -> dict[str, float]:
    """For each format of `MARGIN_FORMATS`: the start-up check's largest difference between the served rows and the
    format's reference, as a share of the logits' scale (`selfcheck.tolerance` bounds it), with the kernels this
    process builds."""
    import anyio

    from jitney import Engine, EngineConfig
    from jitney.core import selfcheck

    worst: dict[str, float] = {}

    async def enter(name: str, config: dict) -> None:
        def measure(engine, reference, sequences, own=None):
            served, _ = selfcheck.served_logits(engine, sequences)
            worst[name] = max(selfcheck.logit_error(s, r) for s, r in zip(served, reference) if s is not None)

        real, selfcheck.check = selfcheck.check, measure
        try:
            async with Engine.from_pretrained(model, EngineConfig(**config)):
                pass
        finally:
            selfcheck.check = real

    for config in MARGIN_FORMATS:
        name = " + ".join(f"{v} {k.split('_')[0]}" for k, v in config.items()) or "fp32"
        anyio.run(enter, name, config)
    return worst


def run_target(level: str, tune: str, tests: list[str], with_margins: bool) -> dict:
    """Build for (level, tune) in a child process and run `tests` against it: a row of the table."""
    row = {"level": level, "tuning": tune or "default"}
    env = {**os.environ, "JITNEY_KERNEL_LEVEL": level, "JITNEY_KERNEL_TUNE": tune}
    missing = native.lacking(level)
    if missing:
        return {**row, "result": f"not run: this CPU lacks {' '.join(missing)}"}
    start = time.monotonic()
    build = subprocess.run([sys.executable, "-c", "from jitney.kernels import native; native.load()"], env=env, cwd=ROOT,
                           capture_output=True, text=True)
    if build.returncode:
        return {**row, "result": "build failed", "detail": build.stderr[-2000:]}
    row["build_s"] = round(time.monotonic() - start, 1)
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-500:]
    row.update(tests=len(tests), test_s=round(time.monotonic() - start, 1), result=summary.strip("= "))
    row["passed"] = run.returncode == 0
    if run.returncode:
        row["detail"] = "\n".join(line for line in run.stdout.splitlines() if line.startswith(("FAILED", "ERROR")))
    if with_margins:
        child = subprocess.run([sys.executable, "-m", "jitney.bench.levels", "--print-margins"], env=env, cwd=ROOT,
                               capture_output=True, text=True)
        row["margins"] = json.loads(child.stdout.strip().splitlines()[-1]) if child.returncode == 0 else child.stderr[-500:]
    return row


def table(rows: list[dict]) -> str:
    """The rows as the markdown table docs/reliability.md keeps."""
    formats = next((list(r["margins"]) for r in rows if isinstance(r.get("margins"), dict)), [])
    head = ["level", "tuning", "build s", "tests", "result"] + [f"check: {f}" for f in formats]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        m = r.get("margins") if isinstance(r.get("margins"), dict) else {}
        cells = [r["level"], r["tuning"], str(r.get("build_s", "-")), str(r.get("tests", "-")), r["result"]]
        lines.append("| " + " | ".join(cells + [f"{m[f]:.2e}" if f in m else "-" for f in formats]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jitney.bench.levels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="all",
                        help="comma-separated LEVEL or LEVEL:TUNING (default: the whole matrix, `TARGETS`)")
    parser.add_argument("--tests", choices=list(TESTS), default="full")
    parser.add_argument("--margins", action="store_true", help="also measure the start-up check per format (SmolLM2)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the rows to this file")
    parser.add_argument("--print-margins", action="store_true", help=argparse.SUPPRESS)  # (the child's part)
    args = parser.parse_args(argv)
    if args.print_margins:
        print(json.dumps(margins()))
        return 0
    targets = TARGETS if args.targets == "all" else [tuple((t + ":").split(":")[:2]) for t in args.targets.split(",")]
    unknown = [level for level, _ in targets if level not in native.LEVELS]
    if unknown:
        parser.error(f"unknown level(s) {', '.join(unknown)}: one of {', '.join(native.LEVELS)}")
    rows = []
    for level, tune in targets:
        print(f"{level} {tune or '(default tuning)'}: building and testing...", file=sys.stderr, flush=True)
        rows.append(run_target(level, tune, TESTS[args.tests], args.margins))
        print(f"  {rows[-1]['result']}", file=sys.stderr, flush=True)
        if rows[-1].get("detail"):
            print(re.sub("^", "    ", rows[-1]["detail"], flags=re.M), file=sys.stderr)
    print(table(rows))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("passed", True) and r["result"] != "build failed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
