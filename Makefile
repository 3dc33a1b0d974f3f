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
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: that is a failure here"; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m benchmarks

clean:
	rm -rf runs data .pytest_cache
