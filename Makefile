# coreshell: `make run` trains the default recipe, `make test` runs the whole suite.
# Both create or reuse the virtual environment $(VENV) and install the project into it when
# pyproject.toml (or the checkout's location) changed.
VENV ?= .venv
# the suite in two worker processes, each test file whole in one (its module fixtures run once),
# files in collection order: tests/conftest.py puts the ones that take minutes first; the 30
# slowest tests are listed at the end (the suite should stay near 20 minutes on 2 cores)
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder --durations=30
PYTHON ?= python3
PY := $(VENV)/bin/python
# torch and torchaudio are CUDA builds on the registry (~8 GB with their nvidia libraries):
# they go in first, alone, with the versions pyproject.toml pins (one source of truth).
TORCH_PINS := $(shell grep -oE '"torch(audio)?==[^"]+"' pyproject.toml | tr -d '"')
# PyTriton and its client pin numpy<2 / ml-dtypes<=0.5.4, which jax cannot use: installed
# without their pins (their other requirements come with the `triton` extra of pyproject.toml).
TRITON_NODEPS := nvidia-pytriton==0.7.0 tritonclient==2.73.0
STAMP := $(VENV)/.coreshell-$(shell (pwd; cat pyproject.toml) | sha256sum | cut -c1-16)

.PHONY: run test bench lint install

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PINS)
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(TRITON_NODEPS)
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

# torch's whole op database through the trace (values and gradients; ~15 min of CPU): rewrites
# the table in docs/torch_model.md; `make opinfo ARGS="--ops polygamma,linalg.lstsq"` reruns rows
.PHONY: opinfo
opinfo: $(STAMP)
	nice -n 10 $(PY) -m tests.torchshell.opinfo_sweep $(ARGS)
