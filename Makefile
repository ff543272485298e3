# Local bootstrap: a CPU torch (pinned: never let pip pull a multi-GB CUDA build
# here) and the mpich wheel, so a laptop or CI machine needs nothing else.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  := torch==2.13.0

.PHONY: demo test venv clean

$(BIN)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[mpich,plot,test]' $(TORCH)
	touch $@

venv: $(BIN)/.installed

# The main job on an embedded default: a local 2-rank sweep of every collective.
demo: venv
	$(BIN)/commbench run --nprocs 2 --collective all -b 8 -e 1M -f 4 --out results/demo-$$(date +%Y%m%d-%H%M%S).jsonl

test: venv
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) results
