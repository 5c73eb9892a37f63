# The two commands a new machine needs: `make demo` and `make test`. Both create .venv when absent.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test test-fast lint bench clean install peers-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch is pinned here only: the CPU wheel on this kind of machine (an unpinned torch pulls CUDA).
	$(BIN)/pip install --quiet "torch==2.13.0" -e ".[torch,test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/loom demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not integration" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/index_scan.py
	$(BIN)/python benchmarks/balance.py
	$(BIN)/python benchmarks/plan_scale.py
	$(BIN)/python benchmarks/stream_throughput.py

# Peer loaders for side-by-side benchmarks, in their own venv (never loomdata dependencies). Mosaic Streaming
# imports torchvision, which does not load next to the CPU torch: benchmarks/_peer_stubs stands in for it.
peers-venv:
	test -x benchmarks/.venv-peers/bin/python || $(PYTHON) -m venv benchmarks/.venv-peers
	benchmarks/.venv-peers/bin/pip install --quiet "torch==2.13.0" "mosaicml-streaming==0.13.0" boto3
	benchmarks/.venv-peers/bin/pip uninstall --quiet --yes torchvision

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache demo-work
