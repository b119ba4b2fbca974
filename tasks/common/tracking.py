"""A step's tracker run (model/training/trackers.py) from its context: what every training, post-training and
evaluation step hands its ranks."""

from __future__ import annotations

from compass.model.training.trackers import REMOTE_TRACKERS, TrackerRun, flat_params
from compass.tasks.steps.context import StepContext


def tracker_run_of(ctx: StepContext) -> TrackerRun | None:
    """None when the spec lists no tracker beyond TensorBoard (which writes its own event files)."""
    mon = ctx.runtime.how.monitoring
    trackers = tuple(t for t in REMOTE_TRACKERS if t in mon.trackers)
    if not trackers:
        return None
    params = {**flat_params(ctx.config.model_dump(mode="json")), "compass.spec_hash": ctx.spec_hash}
    return TrackerRun(trackers=trackers, project=mon.project or ctx.runtime.run,
                      group=f"{ctx.runtime.run}-{ctx.spec_hash[:8]}" if ctx.spec_hash else ctx.runtime.run,
                      name=f"{ctx.kind}:{ctx.name}", kind=ctx.kind, key=ctx.work_key or f"{ctx.kind}/{ctx.name}",
                      params=params, folder=ctx.runtime.monitoring_dir(ctx.store, ctx.workdir),
                      mlflow_tracking_uri=mon.mlflow_tracking_uri, wandb_mode=mon.wandb_mode)
