# `make test` and `make serve` each set themselves up from a fresh clone.
PYTHON ?= $(shell pyenv which python3.12 2>/dev/null || command -v python3.12 || echo python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test serve install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,serve]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests

serve: $(STAMP)
	$(PY) -m forkjax.serve $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
