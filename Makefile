# Two commands on a fresh machine: `make demo` and `make test`.
# GPU users: make test TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.zerospeed-installed
SHELL := bash
.SHELLFLAGS := -o pipefail -c
# pip on these machines warns about local mirror folders that do not exist; keep the output readable.
QUIET_PIP := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: demo test install bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q $(TORCH_SPEC) $(QUIET_PIP)
	$(PY) -m pip install -q -e '.[test]' $(QUIET_PIP)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/zerospeed launch --nproc-per-node 2 examples/train_gpt.py --config examples/configs/demo_zero2.json

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
