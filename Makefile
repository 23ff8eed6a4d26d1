# make install: .venv with everything; make demo: the main job; make test: the suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# On a machine without an NVIDIA driver, pin torch to a CPU build (a range would pull a multi-GB
# CUDA build). Override e.g. `make install TORCH_SPEC="torch==2.13.0+cpu" PIP_ARGS="--extra-index-url ..."`.
HAS_GPU    := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch>=2.4$(comma)<3,torch==2.13.0)
comma := ,
PIP_ARGS ?=

.PHONY: install demo test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	echo "$(TORCH_SPEC)" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q $(PIP_ARGS) -c $(VENV)/torch-constraint.txt -e ".[test,bench]"
	touch $@

demo: install
	$(PY) -m elastic_train.demo

test: install
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .pytest_cache
