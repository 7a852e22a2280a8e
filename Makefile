# The two commands of the README. Each creates .venv and installs what it needs, once.
# torch is pinned at install time (constraints.txt) so that no CUDA build is downloaded;
# pyproject itself accepts torch>=2.6.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench-buffer gpu attack attack-quick

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m kvrt demo

test: $(STAMP) lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) tools/typecheck.py

# The adversarial suite (a few minutes; `make attack-quick` for a smoke run under two).
attack: $(STAMP)
	$(PY) -m kvrt attack

attack-quick: $(STAMP)
	$(PY) -m kvrt attack --quick

bench-buffer: $(STAMP)
	$(PY) -m kvrt bench buffer
