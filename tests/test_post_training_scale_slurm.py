"""A TRL step as its Slurm job on the suite's one-node cluster: two ranks started with srun inside the job; the time
limit's warning signal mid-training (USR1 to the batch shell, as Slurm sends it `signal_before_s` before the limit)
makes the ranks save a complete checkpoint and stop at the same step, the job requeue itself, and the requeued job
resume from that checkpoint to the weights of an undisturbed run (issue 73, H2: before, the TRL ranks never saw the
stop and an SFT longer than the time limit never finished)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from compass.flows.compiler import compile_spec
from compass.flows.runner import RunContext, run_step
from compass.infra import slurm as slurm_jobs
from compass.infra.layout import WorkFolder
from compass.infra.store import Store
from compass.specs import load_spec
from compass.tasks.post_training.trl_checkpoints import newest_complete
from compass.tasks.steps.context import Runtime
from tests.conftest import cluster_spec, seeded, write_minimal_spec
from tests.test_post_training_scale import POST, TRL_SHAPE, run_steps, spec_with_ranks, weights
from tests.test_slurm import controller_log, release_when_pending, wait_for

pytestmark = pytest.mark.slow

LONGER = {"  pretraining:": POST.replace("max_samples: 48", "max_samples: 160"), "how:\n": TRL_SHAPE % 2}


def test_a_trl_job_near_its_time_limit_saves_stops_requeues_and_resumes(slurm, trl_trained_store: Path,
                                                                         tmp_path: Path):
    pretrained = seeded(tmp_path / "pretrained" / "store", trl_trained_store)
    reference_store = tmp_path / "reference" / "store"
    shutil.copytree(pretrained, reference_store)
    spec_with_ranks(tmp_path / "reference", 2)  # the pairs file the spec names
    reference_spec = write_minimal_spec(tmp_path / "reference", **LONGER)  # the same step, no cluster
    undisturbed = run_steps(reference_spec, reference_store, ["post_train:sft"])["post_train:sft"]

    folder = tmp_path / "cluster"
    spec_with_ranks(folder, 2)
    store_root = folder / "store"
    shutil.copytree(pretrained, store_root)
    loaded = load_spec(cluster_spec(folder, folder / "shared", **LONGER))
    plan = compile_spec(loaded.spec)
    store = Store(str(store_root), loaded.spec.how.orchestration.cluster.shared_root)
    ctx = RunContext(plan, store, loaded.spec_hash, Runtime(how=loaded.spec.how, base_dir=loaded.base_dir))
    step = plan.step("post_train:sft")
    work = WorkFolder(store.work_dir("post_train", "sft", plan.fingerprints[step.id]))
    box: dict = {}

    def run() -> None:
        try:
            box["outcome"] = run_step(ctx, step, logging.getLogger("test.trl.slurm"))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: work.job_record.exists() or not thread.is_alive(), "the step's job")
    assert "error" not in box, box["error"]
    job = slurm_jobs.read_record(work.root).job_id
    wait_for(lambda: newest_complete(work.trl_checkpoints) is not None, "a complete TRL checkpoint")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)  # the time limit is near
    wait_for(lambda: slurm_jobs.state_of(job).state == "PENDING", "the job to requeue itself")
    said = work.slurm_log.read_text()  # before the requeued job starts its own log
    stopped = int(said.split("post_train:sft: stopped at step ")[1].split()[0])  # the ranks saved and stopped
    release_when_pending(job)
    thread.join(600)
    assert "error" not in box, f"{box.get('error')}\ncontroller: {controller_log(slurm)}"
    outcome = box["outcome"]
    metrics = outcome.manifest.metrics
    assert metrics["ranks"] == 2 and outcome.manifest.execution.slurm_job == job  # the same job, restarted
    assert metrics["resumed_from_step"] and metrics["resumed_from_step"] < metrics["steps"]
    assert metrics["resumed_from_step"] == stopped  # resumed from the checkpoint the stop wrote
    assert metrics["steps"] == undisturbed.manifest.metrics["steps"]
    got, want = weights(outcome), weights(undisturbed)
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)
