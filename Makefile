# The two commands: `make demo` runs the demo lifecycle, `make test` runs the test suite.
# Both install what they need first (infra/setup.sh, idempotent).
.PHONY: demo test test-fast test-gpu test-gpu-extras setup lint bench lock

# Python writes the bytecode of what it imports, once, for every later process (infra/setup.sh compiles nothing
# ahead): a machine or CI that sets PYTHONDONTWRITEBYTECODE would otherwise compile torch and transformers again in
# every process (an import of 29 s, not 6).
unexport PYTHONDONTWRITEBYTECODE

setup:
	@bash infra/setup.sh

demo: setup
	.venv/bin/compass validate specs/examples/tiny.yaml
	.venv/bin/compass plan specs/examples/tiny.yaml
	.venv/bin/compass run specs/examples/tiny.yaml

# `make test`: four pytest workers on 2 cores, a test file each at a time (module fixtures stay in one worker): the
# Slurm, Ray and fault tests mostly wait (for jobs, daemons, timeouts: test_rehearsal_faults 465 s of wall for 32 s
# of its own CPU), so more files than cores keep the cores busy meanwhile. Clean clones on this machine: two workers
# 34:58 -> three 28:53 (an older suite); three 37:58 -> four 33:52 (c7474d9; with four the cores were idle 0.6% of
# the run, /proc/stat sampled every 5 s, so a fifth would only add contention). `make test-fast` keeps two: its
# files compute without waiting, and a third worker only oversubscribes the cores (4:33 with three, 2:50 with two,
# back to back). One OpenMP thread per process: workers' processes each spinning two OpenMP threads on two cores
# spent a quarter of the CPU waiting (test_training_core and test_evaluate: 202 s of CPU -> 152 s).
test test-fast: export OMP_NUM_THREADS = 1
test: setup
	.venv/bin/python -m pytest -q -n 4 --dist loadfile --no-loadscope-reorder --durations=30 -m "not gpu" tests

# Everything not marked slow (no end-to-end flows): a few minutes, for iterating.
test-fast: setup
	.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow and not gpu" tests

# The CUDA path on a GPU node (fails without CUDA): NCCL collectives, the first thing to run on a new GPU node.
# On a GPU node: what needs CUDA alone (2-GPU tests skip on one GPU, saying so); the optional extras' tests apart,
# each failing with its install command where its package is missing.
test-gpu: setup
	.venv/bin/python -m pytest -q -m "gpu and not (gpu_extra or bitsandbytes or vllm)" tests

test-gpu-extras: setup
	.venv/bin/python -m pytest -q -m "gpu and (gpu_extra or bitsandbytes or vllm)" tests

# After a dependency change passes the suite: pin what it passed with (infra/setup.sh installs the lock with uv).
lock: setup
	(sed -n 1,2p infra/requirements.lock; .venv/bin/pip freeze --exclude-editable | grep -v -E '^(uv|pip|setuptools|wheel)==') \
		> infra/requirements.lock.new && mv infra/requirements.lock.new infra/requirements.lock

lint: setup
	.venv/bin/ruff check .

# Every script of benchmarks/ at full size (bench_table.BENCHMARKS, in its order), each writing its result file to
# benchmarks/results/; then the table in docs/development.md is rendered from those files.
bench: setup
	cd benchmarks && ../.venv/bin/python curation_throughput.py
	cd benchmarks && ../.venv/bin/python data_throughput.py
	cd benchmarks && ../.venv/bin/python cached_rerun.py
	cd benchmarks && ../.venv/bin/python submission_overhead.py
	cd benchmarks && ../.venv/bin/python pretrain_throughput.py --engine torch
	cd benchmarks && ../.venv/bin/python pretrain_throughput.py --engine deepspeed --variants "bare torch loop,compass trainer,HF Trainer"
	cd benchmarks && ../.venv/bin/python engines.py
	cd benchmarks && ../.venv/bin/python long_sequence_memory.py
	cd benchmarks && ../.venv/bin/python loss_memory.py
	cd benchmarks && ../.venv/bin/python async_checkpoint.py
	cd benchmarks && ../.venv/bin/python evaluation_throughput.py
	cd benchmarks && ../.venv/bin/python post_training_throughput.py
	cd benchmarks && ../.venv/bin/python decontamination_throughput.py
	cd benchmarks && ../.venv/bin/python gpu_throughput.py
	cd benchmarks && ../.venv/bin/python bench_table.py
