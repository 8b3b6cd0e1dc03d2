# Everything runs from a local virtual environment (.venv) that `make setup` builds.
# torch comes first and pinned: the CPU wheel (a bare `torch` would pull CUDA).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TORCH_VERSION ?= 2.13.0
# the Triton release on our GPU host, so CPU compile checks see the same compiler
TRITON_VERSION ?= 3.6.0

.PHONY: setup demo test test-unit test-conformance lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q triton==$(TRITON_VERSION) -e ".[dev,triton,jax,models]"
	touch $(STAMP)

setup: $(STAMP)

# A tiny random-weight Llama served through the torch backend on the CPU: three prompts
# (two share a system prompt), two samples each; tokens, tokens/s, KV blocks, prefix hits.
demo: $(STAMP)
	$(VENV)/bin/pagedkv generate --n 2 --temperature 0.8 --seed 0

# The whole CPU suite: unit tests, then conformance (quick level) of every backend
# that runs on a CPU (Triton under its interpreter, Pallas in interpret mode), with
# tiny Hugging Face models served through each (--conformance-models).
test: $(STAMP) lint test-unit test-conformance

test-unit: $(STAMP)
	$(PY) -m pytest -q tests

# The plugin template is installed as a distribution, as a backend author would (into a
# directory of its own, so the environment's unit tests never see it).
test-conformance: $(STAMP)
	rm -rf build/plugin-template
	$(PY) -m pip install -q --no-deps --no-build-isolation --target build/plugin-template \
		./examples/plugin_template
	PYTHONPATH=build/plugin-template TRITON_INTERPRET=1 $(PY) -m pytest -q conformance --conformance-level quick \
		--backend torch --backend triton --backend pallas --backend mla --backend my_backend \
		--conformance-fuzz 10 --conformance-models

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
