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

# The main job on an embedded default, on 2 local ranks (gloo, CPU): a sweep of
# every collective; a plan's collectives and kernels measured; the step predicted
# from them; the prediction checked against real training steps; and a what-if
# scaling prediction from a shipped SystemSpec.
PLAN := --model tiny-gpt --global-batch 8 --dtype fp32
demo: venv
	@set -e; d=results/demo-$$(date +%Y%m%d-%H%M%S); mkdir -p $$d; \
	echo "== 1. every collective, 8 B - 1 MiB, 2 ranks"; \
	$(BIN)/commbench run --nprocs 2 --collective all -b 8 -e 1M -f 4 --out $$d/sweep.jsonl; \
	echo "== 2. the plan: $(PLAN) (DDP over 2 ranks)"; \
	$(BIN)/commbench plan $(PLAN) --world 2 --gpus-per-node 2; \
	echo "== 3. its collectives and kernels, measured"; \
	$(BIN)/commbench run --nprocs 2 $(PLAN) -q --out $$d/plan-comm.jsonl; \
	$(BIN)/commbench compute --nprocs 2 $(PLAN) -q --out $$d/compute.jsonl; \
	echo "== 4. the step predicted from them"; \
	$(BIN)/commbench predict $(PLAN) --world 2 --gpus-per-node 2 --comm $$d/plan-comm.jsonl --compute $$d/compute.jsonl; \
	echo "== 5. validated against real training steps"; \
	$(BIN)/commbench validate $(PLAN) --nprocs 2 --out-dir $$d/validate; \
	echo "== 6. what-if: gpt3-1.3b data parallel on a Polaris-like system, 8 to 512 GPUs"; \
	$(BIN)/commbench predict --model gpt3-1.3b --world 8 --gpus-per-node 4 --global-batch 8 --system polaris \
	    --scale 8,16,32,64,128,256,512; \
	echo "results: $$d"

test: venv
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) results
