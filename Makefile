# The two commands: `make lab` starts the course, `make test` runs every test.
# PY=python3 uses an already prepared interpreter instead of .venv (the GPU test machines).
VENV     ?= .venv
PY       ?= $(VENV)/bin/python
LAB_PORT ?= 8888
JOBS     ?= 2

ifeq ($(PY),$(VENV)/bin/python)
SETUP := $(VENV)/.installed
else
SETUP :=
endif

.PHONY: lab test test-gpu test-gpu-tests test-gpu-notebooks lint unit notebooks bench clean

$(VENV)/.installed: pyproject.toml launch/setup_env.sh
	VENV=$(VENV) bash launch/setup_env.sh

lab: $(SETUP)
	bash launch/start_lab.sh $(PY) $(LAB_PORT)

lint: $(SETUP)
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -n $(JOBS) --dist loadgroup --durations=30 tests --nbmake notebooks

# Same suite on a GPU box; any test or exercise skipped for want of a GPU is a failure. In two halves
# (test-gpu-tests, test-gpu-notebooks) where one command may run at most 10 minutes, as on the lent GPU machines.
test-gpu: test-gpu-tests test-gpu-notebooks

test-gpu-tests: $(SETUP)
	COURSE_REQUIRE_GPU=1 $(PY) -m pytest -n $(JOBS) --dist loadgroup --durations=30 tests

test-gpu-notebooks: $(SETUP)
	COURSE_REQUIRE_GPU=1 $(PY) -m pytest -n $(JOBS) --dist loadgroup --durations=30 --nbmake notebooks

unit: $(SETUP)
	$(PY) -m pytest -n $(JOBS) tests

notebooks: $(SETUP)
	$(PY) -m pytest -n $(JOBS) --nbmake notebooks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
