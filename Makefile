# The two commands: `make demo` and `make test`. Both set up .venv from scratch when it is absent.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlops-installed

.PHONY: demo test install test-fast test-shuffled bench clean

$(STAMP): pyproject.toml constraints/cpu.txt scripts/install.sh
	bash scripts/install.sh dev
	touch $(STAMP)

install: $(STAMP)

DEMO_ARGS ?=
demo: $(STAMP)
	$(VENV)/bin/rlops demo $(DEMO_ARGS)

test: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -x -q --durations=15

# Order must not matter: the whole suite in a random order; SEED=N repeats one (the header prints it).
SEED ?= $(shell python3 -c 'import random; print(random.randrange(10**6))')
test-shuffled: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q --durations=15 --shuffle-seed=$(SEED)

test-fast: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -m "not slow"

clean:
	-$(VENV)/bin/rlops down
	rm -rf .rlops
