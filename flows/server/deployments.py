"""compass's Prefect deployments, declared here and created or updated by `compass deploy`.

Deployments name their flows by module path (`compass.flows.lifecycle.lifecycle`), so a process worker on any machine
with compass installed runs them without shipping code; specs travel as a parameter (the YAML text and its
hash), so a worker needs no copy of the spec file.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from prefect.deployments.runner import EntrypointType

from compass.tasks.steps.kind import GPU_TAG
from compass.tasks.steps.registry import deployment_kinds

LIFECYCLE = "compass-lifecycle/lifecycle"
ABLATIONS = "compass-lifecycle/ablations"
EVALUATION_FLOW = "compass-scheduled-evaluation"
CHECKPOINT_EVALUATION_FLOW = "compass-checkpoint-evaluation"


@dataclass(frozen=True)
class Deployed:
    name: str
    schedule: str | None = None


def ensure_pool(name: str) -> bool:
    """Create the process work pool `name` unless it exists; True when created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            return True
        except ObjectAlreadyExists:
            return False


def ensure_gpu_limit(slots: int) -> None:
    """A tag concurrency limit on `gpu`: the server keeps at most `slots` GPU-tagged steps running at once,
    across every flow run and worker (compass's own scheduler only sees one flow run)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag=GPU_TAG, concurrency_limit=slots)


def deploy_all(pool: str, evaluation: dict[str, Any] | None = None,
               on_checkpoint: dict[str, Any] | None = None) -> list[Deployed]:
    """Create or update the lifecycle and ablation deployments, the scheduled evaluation when given
    (`evaluation`: name, parameters, interval or cron), and the evaluation of each committed checkpoint with its
    automation (`on_checkpoint`: spec name, parameters)."""
    from prefect import deploy

    from compass.flows.lifecycle import lifecycle

    deployments = [
        lifecycle.to_deployment(name="lifecycle", entrypoint_type=EntrypointType.MODULE_PATH,
                                description="The whole lifecycle of one training spec (parameter spec_yaml).",
                                tags=["compass"]),
        lifecycle.to_deployment(name="ablations", entrypoint_type=EntrypointType.MODULE_PATH,
                                # the ablation kinds, and through --until everything they need (data, tokenizer)
                                parameters={"until": deployment_kinds("ablations")}, tags=["compass", "ablations"],
                                description="Only a spec's ablations and what they need."),
    ]
    made = [Deployed(LIFECYCLE), Deployed(ABLATIONS)]
    if evaluation:
        from compass.flows.scheduled_eval import SCAN_ONE_AT_A_TIME, evaluate_new_checkpoints

        deployments.append(evaluate_new_checkpoints.to_deployment(
            name=evaluation["name"], entrypoint_type=EntrypointType.MODULE_PATH,
            interval=evaluation.get("interval"), cron=evaluation.get("cron"),
            parameters=evaluation["parameters"], concurrency_limit=SCAN_ONE_AT_A_TIME, tags=["compass"],
            description="Evaluates checkpoints that have no result for the suite yet."))
        when = f"every {evaluation['interval']}s" if evaluation.get("interval") else evaluation.get("cron")
        made.append(Deployed(f"{EVALUATION_FLOW}/{evaluation['name']}", when))
    if on_checkpoint:
        from compass.flows.scheduled_eval import ONE_EVALUATION_AT_A_TIME, evaluate_committed_checkpoint

        name = f"on-checkpoint-{on_checkpoint['spec']}"
        deployments.append(evaluate_committed_checkpoint.to_deployment(
            name=name, entrypoint_type=EntrypointType.MODULE_PATH, parameters=on_checkpoint["parameters"],
            concurrency_limit=ONE_EVALUATION_AT_A_TIME, tags=["compass"],
            description="Evaluates the checkpoint a compass.checkpoint.committed event names (run by an automation)."))
        made.append(Deployed(f"{CHECKPOINT_EVALUATION_FLOW}/{name}", "on each committed checkpoint"))
    with contextlib.redirect_stdout(sys.stderr):  # Prefect prints its own table: keep stdout for compass
        deploy(*deployments, work_pool_name=pool, print_next_steps_message=False)
    if on_checkpoint:
        ensure_checkpoint_automation(on_checkpoint["spec"], f"{CHECKPOINT_EVALUATION_FLOW}/{name}")
    return made


def ensure_checkpoint_automation(spec_name: str, deployment: str) -> str:
    """An automation that runs `deployment` once for every `compass.checkpoint.committed` event of this spec's
    runs, with the event's checkpoint as the flow's parameter (replacing an automation of the same name)."""

    from prefect.automations import Automation, EventTrigger, Posture, RunDeployment
    from prefect.client.orchestration import get_client

    from compass.flows.live import CHECKPOINT_EVENT

    name = f"compass-evaluate-checkpoints-{spec_name}"
    with get_client(sync_client=True) as client:
        target = client.read_deployment_by_name(deployment)
        for existing in client.read_automations_by_name(name):
            client.delete_automation(existing.id)
    automation = Automation(
        name=name, description=f"Evaluate each checkpoint committed by a run of {spec_name}",
        trigger=EventTrigger(expect={CHECKPOINT_EVENT},
                             match={"prefect.resource.id": "compass.checkpoint.*", "compass.run": spec_name},
                             posture=Posture.Reactive, threshold=1, within=timedelta(0)),
        actions=[RunDeployment(source="selected", deployment_id=target.id,
                               # the store of the run that committed it: where its weights and its results are
                               parameters={"checkpoint": "{{ event.payload.checkpoint }}",
                                           "store_root": "{{ event.payload.store_root }}"})],
    ).create()
    return str(automation.id)
