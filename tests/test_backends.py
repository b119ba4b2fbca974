"""Where a step runs, in one backend per placement with its own verbs (issue 72): `place()` decides, the backend of
the placement (tasks/steps/backends/) acts, and no other module imports the Slurm client, reads a placement's mode
or asks `how.orchestration` where work runs. Every mode has a backend that implements every verb; a verb that has
no meaning where it is asked says so (NotHere) instead of doing something else."""

from __future__ import annotations

import ast
import inspect
import logging
import typing
from dataclasses import replace
from pathlib import Path

import pytest

from compass.infra.manifest import Execution
from compass.specs.how import How, Shape, SlurmCluster
from compass.tasks.steps.backends import (
    BACKENDS,
    Description,
    MachineCheck,
    NotHere,
    Ranks,
    Stage,
    WholeWork,
    launcher_for,
)
from compass.tasks.steps.backends.base import Backend
from compass.tasks.steps.backends.slurm import SlurmBackend
from compass.tasks.steps.placement import Mode, Placement
from tests.conftest import REPO
from tests.test_architecture import imports_of, nodes_outside

BACKENDS_FOLDER = REPO / "tasks" / "steps" / "backends"
PLACEMENT = REPO / "tasks" / "steps" / "placement.py"
SHAPE = Shape(phase="data", nodes=1, devices_per_node=0, cpus_per_node=2, memory_gb=None, time_limit=None,
              whole_nodes=False)
CLUSTER_HOW = How.model_validate({"orchestration": {"cluster": {"shared_root": "/tmp/compass-shared"}}})
log = logging.getLogger("test.backends")


def test_only_the_backends_import_the_slurm_client_and_act_on_a_placement():
    """Before: 13 sites in 8 files branched on launcher flags or re-derived the placement from how.orchestration
    (job arrays behind a string switch, whole-step submission in the runner, a second decision in checkpoint
    evaluation, Slurm checks in validation, a prose copy of place() in the plan)."""
    slurm_client = ("compass.infra.slurm", "compass.infra.shared_probe")
    problems = []
    for layer in ("specs", "infra", "model", "tasks", "flows"):
        for path in sorted((REPO / layer).rglob("*.py")):
            if BACKENDS_FOLDER in path.parents or path.name in ("slurm.py", "shared_probe.py") and layer == "infra":
                continue
            problems += [f"{path.relative_to(REPO)}:{line}: imports {module}" for line, module in imports_of(path)
                         if module.startswith(slurm_client)]

    def reads_mode(node: ast.AST) -> str | None:
        return ast.unparse(node) if isinstance(node, ast.Attribute) and node.attr == "mode" and \
            isinstance(node.ctx, ast.Load) else None

    def asks_the_cluster(node: ast.AST) -> str | None:  # how.orchestration.cluster: where work runs
        return ast.unparse(node) if isinstance(node, ast.Attribute) and node.attr == "cluster" and \
            isinstance(node.ctx, ast.Load) else None

    problems += nodes_outside((BACKENDS_FOLDER, PLACEMENT), reads_mode)
    problems += [p for p in nodes_outside((BACKENDS_FOLDER, PLACEMENT, REPO / "specs"), asks_the_cluster)]
    assert not problems, "\n".join(problems)


def placement_of(mode: Mode) -> Placement:
    return Placement(mode, SHAPE)


def work(workdir: Path) -> WholeWork[str]:
    return WholeWork(what="test:unit", label="test-unit", workdir=workdir, module="json.tool",
                     job_file=workdir / "job.json", job_text=lambda inside: "{}", compute=lambda: "computed here",
                     done=lambda: False, collect=lambda: "collected")


@pytest.mark.parametrize("mode", typing.get_args(Mode))
def test_every_placement_mode_implements_every_verb(mode: Mode, tmp_path: Path):
    backend = launcher_for(placement_of(mode))
    assert type(backend) is BACKENDS[mode] and not inspect.isabstract(type(backend))
    verbs = [name for name, member in vars(Backend).items() if callable(member) and not name.startswith("_")]
    assert set(verbs) == {"run_whole", "start_ranks", "stage_executor", "machine_checks", "describe",
                          "ray_resources", "execution"}
    how = CLUSTER_HOW if mode.startswith("slurm") or mode == "in_slurm_job" else How()

    described = backend.describe(how)
    assert isinstance(described, Description) and described.runs_as and described.launch
    record = backend.execution()
    assert isinstance(record, Execution) and record.mode == mode
    assert backend.ray_resources(How.model_validate({"orchestration": {"task_runner": "ray"}})) in (
        None, {"num_cpus": 0}, {"num_gpus": 0})
    from compass.specs import load_spec

    spec = load_spec(REPO / "tests" / "specs" / "minimal.yaml").spec  # on this machine's CPU: nothing to refuse
    check = MachineCheck(spec, REPO, rehearsal=False, node_paths=dict)
    if isinstance(backend, SlurmBackend):  # the cluster's checks of a spec that names none
        with pytest.raises(NotHere):
            list(backend.machine_checks(check))
    else:
        assert list(backend.machine_checks(check)) == []

    if mode == "slurm_job":  # the orchestrator submits: never computes, never starts ranks or stages itself
        with pytest.raises(NotHere):
            backend.start_ranks(Ranks("json.tool", tmp_path / "job.json", 1, how.hardware), how, log)
        with pytest.raises(NotHere):
            backend.stage_executor(Stage([], 1, tmp_path / "logs", "x"), how, log)
        with pytest.raises(NotHere):  # a Slurm placement under a `how` without a cluster
            backend.run_whole(work(tmp_path), How(), log)
        return
    assert backend.run_whole(work(tmp_path), how, log) == "computed here"
    if mode == "ray_tasks":
        with pytest.raises(NotHere, match="starts no ranks"):
            backend.start_ranks(Ranks("json.tool", tmp_path / "job.json", 1, how.hardware), how, log)
    else:
        assert callable(backend.stage_executor(Stage([], 1, tmp_path / "logs", "x", work_bytes=0), How(), log).run)


def test_a_local_stage_runs_a_datatrove_pipeline_through_its_backend(tmp_path: Path):
    """The executor the local backend gives runs the pipeline's ranks and knows which completed (what run_stage
    reads afterwards)."""
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    source = tmp_path / "in"
    source.mkdir()
    (source / "a.jsonl").write_text('{"text": "one document", "id": "1"}\n{"text": "another", "id": "2"}\n')
    pipeline = [JsonlReader(str(source)), JsonlWriter(str(tmp_path / "out"))]
    executor = launcher_for(Placement("in_process", SHAPE)).stage_executor(
        Stage(pipeline, 2, tmp_path / "logs", "test-copy", work_bytes=0), How(), log)
    executor.run()
    assert executor.get_incomplete_ranks(range(2), skip_completed=True) == []
    assert sorted(p.name for p in (tmp_path / "out").iterdir())


def test_the_plan_describes_each_placement_by_its_backend():
    cluster = How.model_validate({"orchestration": {"cluster": SlurmCluster(shared_root="/shared",
                                                                            partition="gpu").model_dump()}})
    arrays = launcher_for(Placement("slurm_job", SHAPE, tasks=SHAPE)).describe(cluster)
    assert arrays.runs_as.startswith("Slurm jobs; curation and tokenization as job arrays")
    assert arrays.places_devices == "Slurm" and arrays.launch == "Slurm, launch srun"
    assert ("Slurm options", "none") in arrays.settings
    assert launcher_for(Placement("local_ranks", replace(SHAPE, devices_per_node=2))).describe(
        How()).runs_as == "2 ranks (torchrun)"
    assert launcher_for(Placement("ray_tasks", SHAPE)).describe(How()).runs_as == "Ray tasks"
