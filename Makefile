# The README's two commands. Each makes .venv and installs what it needs the first time (scripts/setup_venv.sh:
# torch for the machine, then punica_hf editable), and installs nothing once that is done.
#   make demo   the main job: one batch, several adapters, each doing its own task
#   make test   the tests (GPU tests skip without a GPU); PYTEST_ARGS="-m gpu" and the like go to pytest
VENV ?= .venv
PYTEST_ARGS ?=
SETUP_INPUTS := pyproject.toml setup.py scripts/setup_venv.sh

.PHONY: demo test clean-venv

demo: $(VENV)/.installed-library
	$(VENV)/bin/punica-hf demo

test: $(VENV)/.installed-test
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

$(VENV)/.installed-library: $(SETUP_INPUTS)
	VENV=$(VENV) scripts/setup_venv.sh ""
	@touch $@

$(VENV)/.installed-test: $(SETUP_INPUTS)
	VENV=$(VENV) scripts/setup_venv.sh test
	@touch $@ $(VENV)/.installed-library  # the test extras include the library: the demo is set up too

clean-venv:
	rm -rf $(VENV)
