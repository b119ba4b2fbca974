"""Where every step runs, decided once (tasks/steps/placement.py): each phase's shape with its defaults from
`how.hardware`, the placement of every kind with and without a cluster, the Slurm job each shape asks for, the
srun line that binds each rank to its CPUs and GPU, and a new kind that declares its own resources in its module.
The same decisions on a real Slurm cluster: tests/test_placement_slurm.py."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from compass.flows.compiler import compile_spec
from compass.infra.slurm import ranks_command, request_for, sbatch_script
from compass.specs import load_spec
from compass.specs.how import How, SlurmCluster
from compass.tasks.steps import registry
from compass.tasks.steps.placement import driver, place
from tests import step_kind_example
from tests.conftest import REPO, write_minimal_spec

H100S = {"hardware": {"accelerator": "h100", "devices_per_node": 8, "nodes": 48, "cpus_per_node": 88},
         "parallelism": {"data_parallel": 192, "tensor_parallel": 2},
         "resources": {"long_context": {"nodes": 3}, "ablation": {"time_limit": "12:00:00"}},
         "orchestration": {"cluster": {"kind": "slurm", "partition": "hopper", "time_limit": "2-00:00:00",
                                       "shared_root": "/fsx/compass"}}}


def test_each_phase_takes_its_shape_with_defaults_from_the_hardware():
    how = How.model_validate(H100S)
    shapes = {phase: how.shape(phase) for phase in ("data", "ablation", "pretraining", "long_context",
                                                     "mid_training", "post_training", "evaluation")}
    assert {p: (s.nodes, s.devices_per_node) for p, s in shapes.items()} == {
        "data": (1, 0), "ablation": (1, 8), "pretraining": (48, 8), "long_context": (3, 8), "mid_training": (48, 8),
        "post_training": (1, 1), "evaluation": (1, 1)}
    assert {s.cpus_per_node for s in shapes.values()} == {88}
    assert shapes["ablation"].time_limit == "12:00:00" and shapes["pretraining"].time_limit == "2-00:00:00"
    assert shapes["long_context"].whole_nodes and not shapes["evaluation"].whole_nodes
    assert (how.data_parallel("long_context"), how.data_parallel("ablation")) == (12, 4)  # 24 and 8 GPUs at TP 2


def test_the_placement_follows_the_cluster_the_ranks_and_the_task_runner(tmp_path: Path):
    loaded = load_spec(write_minimal_spec(tmp_path))
    plan = compile_spec(loaded.spec)
    kinds = {s.kind: s for s in plan.steps}

    def modes(how: How) -> dict[str, str]:
        return {kind: place(registry.kind(kind), step.config, how).mode for kind, step in kinds.items()}

    how = loaded.spec.how
    assert set(modes(how).values()) == {"in_process"}
    two = how.model_validate({**how.model_dump(), "hardware": {"devices_per_node": 2},
                              "parallelism": {"data_parallel": 2, "micro_batch_size": 1}})
    assert modes(two)["pretrain"] == "local_ranks" and modes(two)["curate"] == "in_process"
    ray = how.model_validate({**how.model_dump(), "orchestration": {"task_runner": "ray"}})
    assert (modes(ray)["curate"], modes(ray)["ingest"], modes(ray)["pretrain"]) == ("ray_tasks", "ray_tasks",
                                                                                     "in_process")
    tiny = load_spec(REPO / "specs" / "examples" / "tiny.yaml").spec
    tiny_kinds = {s.kind: s for s in compile_spec(tiny).steps}
    cluster = tiny.how.model_validate({**tiny.how.model_dump(), "orchestration": {"cluster": {"shared_root": "/fsx"}}})
    placed = {k: place(registry.kind(k), s.config, cluster) for k, s in tiny_kinds.items()}
    bookkeeping = {"compare", "curves", "report"}  # they read other steps' manifests, never a model or a corpus
    assert {k for k, p in placed.items() if p.mode == "slurm_job"} == set(tiny_kinds) - bookkeeping
    assert {(placed[k].mode, placed[k].shape) for k in bookkeeping} == {("in_process", None)}
    assert {k: placed[k].shape.phase for k in ("gate", "ingest", "ablate", "pretrain", "long_context", "post_train",
                                               "evaluate") if k in placed} == {
        "ingest": "data", "ablate": "ablation", "pretrain": "pretraining", "long_context": "long_context",
        "post_train": "post_training", "evaluate": "evaluation"}
    arrays = {k for k, p in placed.items() if p.tasks is not None}  # datatrove stages as Slurm job arrays
    assert arrays == {"ingest", "curate", "tokenize", "decontaminate"}  # the fence scans as curation does
    for kind in arrays:  # a one-CPU driver job; the data phase's shape goes to the arrays
        assert (placed[kind].shape.nodes, placed[kind].shape.cpus_per_node) == (1, 1)
        assert placed[kind].tasks == cluster.shape("data")
    assert all(p.tasks is None for p in (place(registry.kind(k), s.config, how) for k, s in kinds.items()))

def test_a_new_kind_declares_its_resources_in_its_own_module(tmp_path: Path):
    registry.register(step_kind_example.KIND)
    try:
        spec = write_minimal_spec(tmp_path, **{"  parallelism: {micro_batch_size: 2}": (
            "  parallelism: {micro_batch_size: 2}\n  orchestration: {cluster: {shared_root: /fsx/compass}}")})
        loaded = load_spec(spec)
        counts = [s for s in compile_spec(loaded.spec).steps if s.kind == "word_count"]
        placed = {place(registry.kind(s.kind), s.config, loaded.spec.how) for s in counts}
        (placement,) = placed
        assert placement.mode == "slurm_job" and placement.shape.cpus_per_node == 1  # its own, not the phase's 2
        assert (placement.shape.phase, placement.shape.devices_per_node) == ("data", 0)
    finally:
        registry.unregister(step_kind_example.KIND.name)


def test_each_shape_asks_slurm_for_what_it_says():
    how = How.model_validate(H100S)
    cluster = how.orchestration.cluster
    command = ("/venv/bin/python", "-m", "compass.tasks.steps.step_job", "/fsx/compass/work/x/step-job.json")
    work = Path("/fsx/compass/work/pretrain/stage1-abc")
    pretrain = request_for(how.shape("pretraining"), cluster, "h100", work, command, "pretrain-stage1")
    assert (pretrain.nodes, pretrain.tasks_per_node, pretrain.cpus_per_task, pretrain.gpus_per_node) == (48, 8, 11, 8)
    script = sbatch_script(pretrain, cluster).splitlines()
    for line in ("#SBATCH --nodes=48", "#SBATCH --ntasks-per-node=8", "#SBATCH --cpus-per-task=11",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --partition=hopper", "#SBATCH --time=2-00:00:00",
                 "#SBATCH --requeue", "#SBATCH --signal=B:USR1@120", "trap on_time_limit USR1",
                 f"#SBATCH --output={work}/slurm.log", f"{shlex.join(command)} &"):
        assert line in script, line
    assert "#SBATCH --exclusive" not in script  # the spec named the CPUs: no need to ask for the whole node
    assert "#SBATCH --mem=0" in script  # every GPU of its nodes and no memory_gb: all their memory, not the default
    sized = how.model_validate({**how.model_dump(), "resources": {"pretraining": {"memory_gb": 1500}}})
    sized_script = sbatch_script(request_for(sized.shape("pretraining"), cluster, "h100", work, command, "x"), cluster)
    assert "#SBATCH --mem=1536000M" in sized_script and "#SBATCH --mem=0" not in sized_script

    whole = how.model_validate({**how.model_dump(), "hardware": {**H100S["hardware"], "cpus_per_node": None}})
    assert request_for(whole.shape("pretraining"), cluster, "h100", work, command, "x").exclusive
    evaluation = request_for(whole.shape("evaluation"), cluster, "h100", work, command, "x")
    assert (evaluation.nodes, evaluation.tasks_per_node, evaluation.gpus_per_node, evaluation.exclusive) == (
        1, 1, 1, False)  # one GPU of a node: the rest stays for others
    assert "--mem" not in sbatch_script(evaluation, cluster)  # and so does its memory
    data = request_for(how.shape("data"), cluster, "h100", work, command, "x")
    assert (data.gpus_per_node, data.tasks_per_node, data.cpus_per_task) == (None, 1, 88)
    torchrun = request_for(how.shape("ablation"), cluster.model_copy(update={"launch": "torchrun"}), "h100", work,
                           command, "x")
    assert (torchrun.tasks_per_node, torchrun.cpus_per_task, torchrun.time_limit) == (1, 88, "12:00:00")
    # a phase with a partition of its own (data on CPU nodes, where GPU partitions take only GPU jobs); the driver
    # of its job arrays goes there too
    split = how.model_validate({**how.model_dump(), "resources": {"data": {"partition": "cpu-nodes"}}})
    data_script = sbatch_script(request_for(split.shape("data"), cluster, "h100", work, command, "x"), cluster)
    assert "#SBATCH --partition=cpu-nodes" in data_script and "#SBATCH --partition=hopper" not in data_script
    assert driver(split.shape("data")).partition == "cpu-nodes" and split.shape("pretraining").partition == "hopper"


def test_srun_binds_each_rank_to_its_share_of_the_node(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "88")
    monkeypatch.setenv("COMPASS_HEAD", "gpu-001")
    module = ["-m", "compass.model.training.trainer", "/fsx/job.json"]
    per_rank = ranks_command(module, "/venv/bin/python", 2, 8, 29500, "srun", gpus=True)
    # every rank sees its node's 8 GPUs and opens the one at its local rank (a GPU bound per task would be its
    # cuda:0, while DeepSpeed, DDP and accelerate open cuda:LOCAL_RANK)
    assert per_rank[:6] == ["srun", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=8", "--cpus-per-task=11",
                            "--gpus-per-node=8"]
    assert not any(flag.startswith(("--gpu-bind", "--gpus-per-task")) for flag in per_rank)
    script = per_rank[-1]
    for variable in ("RANK=$SLURM_PROCID", "LOCAL_RANK=$SLURM_LOCALID", "WORLD_SIZE=$SLURM_NTASKS",
                     "LOCAL_WORLD_SIZE=8", "MASTER_ADDR=gpu-001 MASTER_PORT=29500"):
        assert variable in script, variable
    assert script.endswith(shlex.join(["/venv/bin/python", *module]))
    per_node = ranks_command(module, "/venv/bin/python", 2, 8, 29500, "torchrun", gpus=True)
    assert per_node[:6] == ["srun", "--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=88",
                            "--gpus-per-node=8"]
    assert '--node-rank "$SLURM_NODEID"' in per_node[-1] and "--nproc-per-node 8" in per_node[-1]
    assert "--master-addr gpu-001" in per_node[-1]


def test_the_slurm_word_fields_refuse_what_would_reach_the_batch_script():
    with pytest.raises(ValueError):
        SlurmCluster(partition="gpu\n#SBATCH --uid=0")
    with pytest.raises(ValueError):
        How.model_validate({"resources": {"pretraining": {"time_limit": "2 days"}}})


FAKE_SRUN = """#!/bin/bash
echo "rank 0 on node1: started" >&2
{lost}
exit {code}
"""


@pytest.mark.parametrize("lost", [True, False])
def test_ranks_srun_cannot_start_on_a_lost_node_are_a_retriable_fault_and_a_failing_rank_is_not(
        lost: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A node lost after its job began but before srun started the ranks there: srun says so in its own words and
    exits; the step notes it as retriable (the batch shell then requeues the job). Before, the job ended FAILED and
    waited for an orchestrator. A rank that failed by itself (srun exits without those words) stays a failure. srun
    here is a stand-in on PATH saying what Slurm 22.05 says (the real one: tests/test_rehearsal_node_lost.py)."""
    import logging

    from compass.infra.exits import clear_retriable, retriable_reasons
    from compass.specs.how import Hardware, How, Shape
    from compass.tasks.steps.backends import Ranks, launcher_for
    from compass.tasks.steps.placement import Placement

    words = ('echo "srun: error: Task launch for StepId=12.0 failed on node node2: Communication connection '
             'failure" >&2' if lost else 'echo "Traceback: ValueError: a bug" >&2')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(lost=words, code=233 if lost else 1))
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    work = tmp_path / "work"
    work.mkdir()
    shape = Shape(phase="post_training", nodes=2, devices_per_node=1, cpus_per_node=None, memory_gb=None,
                  time_limit=None, whole_nodes=False)
    backend = launcher_for(Placement("in_slurm_job", shape))
    hardware = Hardware(accelerator="cpu", nodes=2, devices_per_node=1)
    code = backend.start_ranks(Ranks("compass.tasks.post_training.trl_ranks", work / "job.json", 2, hardware), How(),
                               logging.getLogger("test"))
    assert code == (233 if lost else 1)
    reasons = retriable_reasons(work)
    if lost:
        assert reasons == ["srun could not start the ranks on node2: Communication connection failure"]
        clear_retriable(work)
        assert retriable_reasons(work) == []
    else:
        assert reasons == []
