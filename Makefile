# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SPEC ?= deployments/specs/local-cpu.yaml
PYTEST_ARGS ?=

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_UI_ENABLED ?= false
# No hub, no telemetry: nothing at run time reaches the internet.
export HF_DATASETS_OFFLINE := 1
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export DO_NOT_TRACK := 1

.PHONY: install demo test lint bench faults ui clean

install: $(STAMP)

# Re-install only when the dependency list changes; the stamp makes the second run a no-op.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tessera run $(SPEC)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: that is a failure here"; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m benchmarks

# The fault-injection suite; each fault test records its measured row, rendered into
# benchmarks/results/faults.{json,md} even when a test fails (the table then shows it).
FAULT_ROWS := runs/faults_rows.jsonl
faults: $(STAMP)
	rm -f $(FAULT_ROWS)
	TESSERA_FAULT_REPORT=$(FAULT_ROWS) $(BIN)/python -m pytest -m fault $(PYTEST_ARGS); rc=$$?; \
	  $(BIN)/python -m benchmarks.faults_report $(FAULT_ROWS) && exit $$rc

# A local Prefect server with its UI on 127.0.0.1:4200, the work pools and every deployment of
# prefect.yaml registered, and a worker for tessera-cpu in the foreground; Ctrl-C stops both.
UI_API := http://127.0.0.1:4200/api
ui: $(STAMP)
	PREFECT_UI_ENABLED=true $(BIN)/prefect server start --host 127.0.0.1 --port 4200 & server=$$!; \
	  trap 'kill $$server' EXIT INT TERM; \
	  until $(BIN)/python -c "import urllib.request; urllib.request.urlopen('$(UI_API)/health')" 2>/dev/null; \
	    do sleep 1; done; \
	  export PREFECT_API_URL=$(UI_API); \
	  $(BIN)/tessera deploy --no-write && echo "UI: http://127.0.0.1:4200" && \
	  $(BIN)/prefect worker start --pool tessera-cpu --type process

clean:
	rm -rf runs data .pytest_cache
