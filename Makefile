# modulec: `make setup` then `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: setup test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: the local CPU wheel, never a resolve from the index
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[runtime,dev]"
	touch $@

test: setup
	$(PY) -m pytest tests

lint: setup
	$(PY) -m pytest tests/test_grammar.py -q

bench: setup
	$(PY) benchmarks/parse_speed.py

clean:
	rm -rf $(VENV) build *.egg-info
