# modulec: `make setup` then `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
NPM    ?= npm
VSCODE := editors/vscode

.PHONY: setup test lint bench clean grammar grammar-snapshots graphviz

setup: $(VENV)/.installed $(VSCODE)/node_modules/.installed graphviz

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: the local CPU wheel, never a resolve from the index
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[runtime,dev,pictures]"
	touch $@

# The TextMate grammar tests' tool (vscode-tmgrammar-test), pinned by editors/vscode/package-lock.json.
# Without npm, setup goes on; tests/test_highlighting.py skips the grammar tests when node is missing.
$(VSCODE)/node_modules/.installed: $(VSCODE)/package.json $(VSCODE)/package-lock.json
	@if command -v $(NPM) >/dev/null 2>&1; then \
	  $(NPM) ci --prefix $(VSCODE) --no-audit --no-fund && touch $@; \
	else echo "npm not found: editors/vscode not installed (the TextMate grammar tests need it)"; fi

# `dot` draws `modulec graph --format svg|png` (tests/test_pictures.py needs it); as root
# (CI) it is installed from Debian's packages, others are told what to install.
graphviz:
	@command -v dot >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) || \
	  echo "graphviz not found: install it (apt-get install graphviz) for modulec graph --format svg|png"; }

grammar: setup
	$(PY) grammar/generate_tmlanguage.py

grammar-snapshots: setup
	$(PY) tests/grammar/run_grammar_tests.py snap --update

# two workers (pytest-xdist), each gloo test picks free ports, so workers do not collide;
# whole files handed out in collection order, where tests/conftest.py puts the files of the
# longest tests first, so that both workers end together (the budget and how to measure
# it: docs/decisions.md, "CI time budget")
test: setup
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder tests

lint: setup
	$(PY) -m pytest tests/test_grammar.py -q

bench: setup
	$(PY) benchmarks/parse_speed.py

clean:
	rm -rf $(VENV) build *.egg-info $(VSCODE)/node_modules
