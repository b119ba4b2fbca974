"""compass's Prefect deployments, declared here and created or updated by `compass deploy`.

Deployments name their flows by module path (`compass.flows.lifecycle.lifecycle`), so a process worker on any machine
with compass installed runs them without shipping code; specs travel as a parameter (the YAML text and its
hash), so a worker needs no copy of the spec file.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any

from prefect.deployments.runner import EntrypointType

from compass.tasks.registry import deployment_kinds
from compass.tasks.steps import GPU_TAG

LIFECYCLE = "compass-lifecycle/lifecycle"
ABLATIONS = "compass-lifecycle/ablations"
EVALUATION_FLOW = "compass-scheduled-evaluation"


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


def deploy_all(pool: str, evaluation: dict[str, Any] | None = None) -> list[Deployed]:
    """Create or update the lifecycle and ablation deployments, and the scheduled evaluation when given
    (`evaluation`: name, parameters, interval or cron)."""
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
    with contextlib.redirect_stdout(sys.stderr):  # Prefect prints its own table: keep stdout for compass
        deploy(*deployments, work_pool_name=pool, print_next_steps_message=False)
    return made
