# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv (CPU torch 2.13.0, triton, pytest, ...) on first use.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed

.PHONY: demo test aot bench venv clean

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q setuptools wheel pybind11
	$(PIP) install -q "triton>=3.3" pytest numpy zstandard safetensors matplotlib tqdm
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

# Main job: the example async GRPO + IcePop trainer on CPU (runs/demo: metrics, plot, checkpoint).
demo: $(STAMP)
	$(PY) -m examples.async_trainer --out-dir runs/demo

# The whole test suite, the interpreter included, then the sm_90 ahead-of-time compile check.
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests; rc=$$?; \
	  if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi
	$(PY) benchmarks/aot_report.py --check

aot: $(STAMP)
	$(PY) benchmarks/aot_report.py

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf .venv build *.egg-info
