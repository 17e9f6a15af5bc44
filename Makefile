# antdt: `make demo` sets up .venv and runs the main job; `make test` sets up and runs the
# default tier of the tests, `make test-full` every test (what CI runs).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU stack by default. A CUDA machine: make setup TORCH="torch==2.13.0 --index-url \
#   https://download.pytorch.org/whl/cu128" FBGEMM=fbgemm-gpu==1.8.0
TORCH  ?= torch==2.13.0
FBGEMM ?= fbgemm-gpu-cpu==1.8.0
# pip byte-compiles what it installs one file at a time (half of the set-up's time): the set-up
# installs without compiling, then compiles everything on every core. As with pip, a module that
# does not compile here (a few of torch's test files, written for newer Pythons) is only logged.
PIP    := $(BIN)/python -m pip install --disable-pip-version-check --no-compile
STAMP  := $(VENV)/.antdt-installed
# pip's own output goes to a log, shown only when a step fails: with the CPU build of fbgemm-gpu
# pip reports that torchrec "requires fbgemm-gpu, which is not installed" (expected, harmless)
SETUP_LOG := $(VENV)/setup.log
LOGGED := >> $(SETUP_LOG) 2>&1 || { cat $(SETUP_LOG) >&2; echo "setup failed: $(SETUP_LOG)" >&2; exit 1; }

.PHONY: setup test-tools demo demo-data test test-full bench typecheck clean constraints
setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	@echo "setup: $(VENV) (pip's log: $(SETUP_LOG))"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@: > $(SETUP_LOG)
	@echo "setup: $(TORCH), $(FBGEMM), torchrec==1.8.0"
	@$(PIP) $(TORCH) $(LOGGED)
	@$(PIP) $(FBGEMM) $(LOGGED)
	@$(PIP) --no-deps torchrec==1.8.0 $(LOGGED)
	@echo "setup: antdt and its dependencies (versions pinned in constraints.txt)"
	@$(PIP) -c constraints.txt -e '.[dev,airflow]' $(LOGGED)
	@echo "setup: byte-compiling the installed packages"
	@$(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c 'import sysconfig; \
		print(sysconfig.get_paths()["purelib"])') >> $(SETUP_LOG) 2>&1 || true
	@touch $(STAMP)

DEMO_DATA := demo-data/synthetic

demo: setup $(DEMO_DATA)/oracle.json
	$(BIN)/antdt train jobs/synthetic.yaml --mode async --workers 2

demo-data: $(DEMO_DATA)/oracle.json

$(DEMO_DATA)/oracle.json: | $(STAMP)
	$(BIN)/antdt data synth $(DEMO_DATA) --rows 2800000 --days 7 --seed 0

# What the tests run besides Python, from Debian's packages where it is missing: Chromium and
# its driver for the browser tests (no browser download: Selenium drives /usr/bin/chromium
# through /usr/bin/chromedriver), Prometheus's promtool to check and test the alerting rules.
TOOLS_LOG := $(VENV)/test-tools.log
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
test-tools:
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver -a -x /usr/bin/promtool || { \
		echo "test-tools: installing Debian's chromium, chromium-driver and prometheus" \
			"(log: $(TOOLS_LOG))"; \
		mkdir -p $(VENV); \
		$(SUDO) apt-get update > $(TOOLS_LOG) 2>&1 && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y --no-install-recommends \
			chromium chromium-driver prometheus >> $(TOOLS_LOG) 2>&1 \
			|| { cat $(TOOLS_LOG) >&2; exit 1; }; }

# The default tier (every guarantee at a small size) and the full tier (--runslow: the tests
# marked slow too; what CI runs). tests/README.md says what each holds.
test: setup test-tools
	$(BIN)/python -m pytest -q --durations=15

test-full: setup test-tools
	$(BIN)/python -m pytest -q --runslow --durations=25

bench: setup $(DEMO_DATA)/oracle.json
	$(BIN)/antdt bench data --json
	$(BIN)/antdt bench train --json
	$(BIN)/antdt bench sharding --json
	$(BIN)/antdt bench quality --json
	$(BIN)/antdt bench scaling --json
	$(BIN)/antdt bench sync --json
	$(BIN)/antdt bench stragglers --scenario none,persistent,transient,hang,crash --json

typecheck: setup
	$(BIN)/python -m mypy antdt models pipeline

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

constraints: setup
	(head -2 constraints.txt; $(BIN)/pip freeze --exclude-editable \
	  | grep -v -i -E '^(torch==|torchrec|fbgemm|antdt)') > constraints.txt.new
	mv constraints.txt.new constraints.txt
