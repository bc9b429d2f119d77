# coreshell: `make run` trains the default recipe, `make test` runs the whole suite.
# Both create or reuse the virtual environment $(VENV) and install the project into it when
# pyproject.toml (or the checkout's location) changed.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# torch and torchaudio are CUDA builds on the registry (~8 GB with their nvidia libraries):
# they go in first, alone, with the versions pyproject.toml pins (one source of truth).
TORCH_PINS := $(shell grep -oE '"torch(audio)?==[^"]+"' pyproject.toml | tr -d '"')
STAMP := $(VENV)/.coreshell-$(shell (pwd; cat pyproject.toml) | sha256sum | cut -c1-16)

.PHONY: run test bench lint install

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PINS)
	$(PY) -m pip install --quiet -e '.[dev]'
	@rm -f $(VENV)/.coreshell-*
	@touch $@

run: $(STAMP)
	$(VENV)/bin/coreshell train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/run.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check jaxcore bridge torchshell tests benchmarks
	$(VENV)/bin/ruff format --check jaxcore bridge torchshell tests benchmarks
	$(VENV)/bin/mypy
