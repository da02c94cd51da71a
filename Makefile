PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-real install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[profile,serve,operator,web,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m hetsched.demo

test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/mypy hetsched
	$(BIN)/python -m pytest

test-real: $(STAMP)
	PYTHON=$(PYTHON) bash tests/real/run.sh

clean:
	rm -rf $(VENV) build *.egg-info
