# One entry point for people and CI. `make demo` sets up .venv and compiles the bundled
# example; `make test` sets up .venv and runs the whole suite.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
EXTRAS := onnxruntime,openvino,tensorflow,torch,paddle,mnn,mindspore,ncnn,tvm,service,dev

.PHONY: setup demo test lint typecheck lock benchmarks smoke clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[$(EXTRAS)]'
	$(BIN)/pip check
	touch $@

demo: setup
	$(BIN)/kiln compile examples/tiny_cnn.onnx --target onnxruntime --target openvino \
		--repo model-repository --name tiny-cnn

test: setup
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check api services workers cli tests benchmarks docker
	$(BIN)/ruff format --check api services workers cli tests benchmarks docker

# The packages' sources (pyproject's [tool.mypy] files); tests and benchmarks are scripts.
typecheck: setup
	$(BIN)/mypy

lock: setup
	$(BIN)/pip freeze --exclude-editable | grep -v '^kiln' > constraints.txt.new && mv constraints.txt.new constraints.txt

benchmarks: setup
	$(BIN)/python benchmarks/run_all.py

# Brings the compose stack up for real (needs root: it runs its own Docker engine).
smoke: setup
	$(BIN)/python docker/smoke.py

clean:
	rm -rf $(VENV) model-repository .pytest_cache
