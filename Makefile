# make help       this list
# make run        build the default example (outputs/mlp/cpu-baked-default/)
# make test       lint and type-check, then the whole test suite (about 25 minutes on 2 cores)
# make test-no-compile  lint, type-check and the tests that compile nothing (2-3 minutes on 2 cores)
# make test-slurm the SLURM tests, on a one-node cluster brought up and down for them (tests/slurm/cluster.sh; root)
# make cpp        the C++ library and flashrt-run, built against the venv's torch (build/cpp/)
VENV   ?= .venv
PYTHON := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: help run test test-no-compile test-slurm lint format clean cpp

# (Re)create the venv when it is absent or older than the lock or pyproject.
$(STAMP): requirements.lock pyproject.toml
	rm -rf $(VENV)
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --no-deps -r requirements.lock
	$(PYTHON) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

help:
	@sed -n 's/^# make /make /p' Makefile

run: $(STAMP)
	$(PYTHON) -m flashrt_build +module=mlp

lint: $(STAMP)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

test: lint
	$(PYTHON) -m pytest -q -n auto --dist loadfile

test-no-compile: lint
	$(PYTHON) -m pytest -q -n auto -m "not slow"

# Installs the SLURM packages when missing (apt, as root); where it cannot, says so and exits 0.
test-slurm: $(STAMP)
	tests/slurm/cluster.sh run $(PYTHON) -m pytest -q tests/slurm

cpp: $(STAMP)
	cmake -S cpp -B build/cpp -DCMAKE_PREFIX_PATH="$$($(PYTHON) -c 'import torch; print(torch.utils.cmake_prefix_path)')" \
		-DPython3_EXECUTABLE=$(abspath $(PYTHON))
	cmake --build build/cpp -j

format: $(STAMP)
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .

clean:
	rm -rf $(VENV) build outputs/*/ outputs/.runs outputs/.sweeps
