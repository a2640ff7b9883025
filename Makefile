# The two commands: `make lab` starts the course, `make test` runs every test.
# PY=python3 uses an already prepared interpreter instead of .venv (the GPU test machines).
VENV     ?= .venv
PY       ?= $(VENV)/bin/python
LAB_PORT ?= 8888
LAB_WORKSPACE ?= workspace
# pytest workers: 3 on CI's 2 cores, as the tests wait (timeouts, hangs, grace periods) part of the time
JOBS     ?= 3

ifeq ($(PY),$(VENV)/bin/python)
SETUP := $(VENV)/.installed
else
SETUP :=
endif

.PHONY: lab lab-instructor hub students check reset-notebook collect grade-class return test test-gpu test-gpu-tests test-gpu-tests-1 test-gpu-tests-2 test-gpu-tests-3 test-gpu-tests-4 test-gpu-tests-5 test-gpu-notebooks test-gpu-notebooks-1 test-gpu-notebooks-2 lint unit notebooks clean

$(VENV)/.installed: pyproject.toml launch/setup_env.sh
	VENV=$(VENV) bash launch/setup_env.sh

# Students: their own copies of the lessons in $(LAB_WORKSPACE)/notebooks (git-ignored; solutions replaced by
# `raise NotImplementedError()`), made on first start; new lessons are added, existing ones never overwritten.
lab: $(SETUP)
	COURSE_WORKSPACE=$(LAB_WORKSPACE) bash launch/start_lab.sh $(PY) $(LAB_PORT) student

# Instructors: the masters in notebooks/, solutions included.
lab-instructor: $(SETUP)
	bash launch/start_lab.sh $(PY) $(LAB_PORT) instructor

# A class on one box (docs/classroom.md), as root: `sudo make students ROSTER=roster.txt ADMINS="ada"` makes the
# accounts (random passwords in $(HUB_DIR)/state/initial-passwords.txt), `sudo make hub ROSTER=... ADMINS=...` serves
# one JupyterLab per rostered student (their own workspace, as their own account) and the masters to instructors.
# HUB_AUTH=firstuse: each student picks a password at the first login. HUB_IP=0.0.0.0 opens it to the network
# (with HUB_SSL_CERT/HUB_SSL_KEY); the default is this machine only (students tunnel: ssh -L 8000:127.0.0.1:8000).
# HUB_GPUS: shared (default: every student sees every GPU, cells take turns), each (a GPU per student) or round-robin.
ROSTER    ?= roster.txt
ADMINS    ?=
HUB_AUTH  ?= pam
HUB_IP    ?= 127.0.0.1
HUB_PORT  ?= 8000
HUB_DIR   ?= .hub
HUB_PROXY ?= $(HUB_DIR)/proxy/node_modules/.bin/configurable-http-proxy
HUB_SSL_CERT ?=
HUB_SSL_KEY  ?=
HUB_GPUS  ?= shared
# HUB_SPAWNER=slurm: each server is a Slurm job of its own asking for HUB_SLURM_GPUS GPUs (--gres=gpu:N; 0: none),
# in HUB_SLURM_PARTITION (default: Slurm's); the nodes reach the hub's API at HUB_API_IP (docs/classroom.md).
HUB_SPAWNER ?= local
HUB_SLURM_GPUS ?= 1
HUB_SLURM_PARTITION ?=
HUB_API_IP ?= 127.0.0.1
# HUB_CULL_IDLE: a server idle this many seconds is stopped (its files stay; 0: never).
HUB_CULL_IDLE ?= 3600

$(HUB_DIR)/proxy/node_modules/.bin/configurable-http-proxy:
	bash launch/hub/setup_proxy.sh $(HUB_DIR)/proxy

hub: $(SETUP) $(HUB_PROXY)
	COURSE_HUB_ROSTER="$(ROSTER)" COURSE_HUB_ADMINS="$(ADMINS)" COURSE_HUB_AUTH=$(HUB_AUTH) COURSE_HUB_IP=$(HUB_IP) \
	    COURSE_HUB_PORT=$(HUB_PORT) COURSE_HUB_DIR="$(HUB_DIR)" COURSE_HUB_PROXY="$(HUB_PROXY)" \
	    COURSE_HUB_SSL_CERT="$(HUB_SSL_CERT)" COURSE_HUB_SSL_KEY="$(HUB_SSL_KEY)" COURSE_HUB_GPUS=$(HUB_GPUS) \
	    COURSE_HUB_SPAWNER=$(HUB_SPAWNER) COURSE_HUB_SLURM_GPUS=$(HUB_SLURM_GPUS) \
	    COURSE_HUB_SLURM_PARTITION="$(HUB_SLURM_PARTITION)" COURSE_HUB_API_IP=$(HUB_API_IP) \
	    COURSE_HUB_CULL_IDLE=$(HUB_CULL_IDLE) \
	    bash launch/hub/start_hub.sh $(PY)

students: $(SETUP)
	COURSE_HUB_DIR="$(HUB_DIR)" $(PY) launch/hub/accounts.py "$(ROSTER)" --admins "$(ADMINS)" \
	    $(if $(filter firstuse,$(HUB_AUTH)),--no-passwords)

# Students: check your own lessons in the workspace as the grader scores them, e.g. `make check NB=07_ring_allreduce`
# (every lesson without NB). A table per lesson; exits non-zero unless every exercise passed (or needs a GPU that this
# machine lacks). Your own code on your own machine: it runs without the grader's sandbox.
MASTER_DIR ?= notebooks
check: $(SETUP)
	$(PY) -m course_utils.grade $(if $(NB),$(LAB_WORKSPACE)/notebooks/$(NB).ipynb,$(LAB_WORKSPACE)/notebooks) \
	    --master-dir $(MASTER_DIR) --strict --no-sandbox

# Start one lesson of the workspace over, e.g. `make reset-notebook NB=02_cuda_streams` (old copy kept in backups/).
reset-notebook: $(SETUP)
	@test -n "$(NB)" || { echo "usage: make reset-notebook NB=02_cuda_streams" >&2; exit 2; }
	$(PY) -m course_utils.workspace --workspace $(LAB_WORKSPACE) reset $(NB)

# Instructors with a class on one box, each student a system user with a workspace in their home (docs/classroom.md):
# `make collect` copies every student's lessons into submissions/, `make grade-class` grades them into grades/,
# `make return` puts each student's scores and feedback notebooks in their WORKSPACE/notebooks/feedback/ (0700, theirs).
WORKSPACE_TEMPLATE ?= ~{user}/workspace
GRADE_JOBS ?= 4
CLASS_ARGS = --roster $(ROSTER) --workspace-template '$(WORKSPACE_TEMPLATE)'
collect: $(SETUP)
	$(PY) -m course_utils.classroom collect $(CLASS_ARGS)

grade-class: $(SETUP)
	$(PY) -m course_utils.classroom grade $(CLASS_ARGS) --master-dir $(MASTER_DIR) -j $(GRADE_JOBS)

return: $(SETUP)
	$(PY) -m course_utils.classroom return $(CLASS_ARGS)

lint: $(SETUP)
	$(PY) -m ruff check .

test: lint
	bash tests/install_browser.sh
	bash launch/hub/setup_proxy.sh $(HUB_DIR)/proxy || echo "setup: no JupyterHub proxy (npm): tests/test_hub.py fails under CI"
	$(PY) -m pytest -n $(JOBS) --dist loadgroup --durations=30 tests --nbmake notebooks

# Same suite on a GPU box; any test or exercise skipped for want of a GPU is a failure. In parts, each meant to
# stay under 10 minutes (one command's limit on the lent GPU machines): every test and notebook that times the GPU
# holds every GPU alone, so a part's GPU work runs one piece after another. The test parts select by marker
# (pyproject.toml): `lesson` (every test under tests/lessons/), `ranks` (tests that start ranks) and `grading`;
# part 1 is everything else. Then the notebooks in two parts. A notebook that its lesson's test executes live is not
# executed twice (tests/conftest.py). Notebook-only runs load tests/conftest.py as a plugin (-p): pytest loads a
# conftest only for the folders it collects, and without it notebooks would share the GPUs and strays would go
# unnoticed.
GPU_PYTEST  := COURSE_REQUIRE_GPU=1 $(PY) -m pytest -n $(JOBS) --dist loadgroup --durations=30
GPU_PART_1  := not lesson and not ranks and not grading
GPU_PART_2  := ranks and not lesson and not grading
GPU_PART_3  := lesson and not ranks
GPU_PART_4  := lesson and ranks
GPU_PART_5  := grading

NB_PYTEST   := -p tests.conftest --nbmake
GPU_NOTEBOOKS_1 := $(wildcard notebooks/0[0-4]_*.ipynb)
GPU_NOTEBOOKS_2 := $(filter-out $(GPU_NOTEBOOKS_1),$(wildcard notebooks/*.ipynb))

test-gpu: test-gpu-tests test-gpu-notebooks

GPU_TEST_PARTS := test-gpu-tests-1 test-gpu-tests-2 test-gpu-tests-3 test-gpu-tests-4 test-gpu-tests-5
test-gpu-tests: $(GPU_TEST_PARTS)

$(GPU_TEST_PARTS): test-gpu-tests-%: $(SETUP)
	$(GPU_PYTEST) tests -m "$(GPU_PART_$*)"

test-gpu-notebooks: test-gpu-notebooks-1 test-gpu-notebooks-2

test-gpu-notebooks-1: $(SETUP)
	$(GPU_PYTEST) $(NB_PYTEST) $(GPU_NOTEBOOKS_1)

test-gpu-notebooks-2: $(SETUP)
	$(GPU_PYTEST) $(NB_PYTEST) $(GPU_NOTEBOOKS_2)

unit: $(SETUP)
	$(PY) -m pytest -n $(JOBS) tests

notebooks: $(SETUP)
	$(PY) -m pytest -n $(JOBS) --dist loadgroup $(NB_PYTEST) notebooks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
