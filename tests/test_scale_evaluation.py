"""Issue 73, C1 at the plan: every evaluate step of the SmolLM3 example timed at full size (checkpoints scored,
tokens one checkpoint's scoring reads, the jobs they take) against the evaluation phase's time limit, and a limit
no checkpoint fits in refused at validation, naming the steps. (Resuming between checkpoints is tested on real
checkpoints in tests/test_evaluate.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO

EXAMPLE = REPO / "specs" / "examples" / "smollm3-3b.yaml"


def test_slurm_time_limits_read_as_sbatch_reads_them():
    from compass.specs.how import slurm_seconds

    assert [slurm_seconds(t) for t in ("10", "10:00", "4:00:00", "2-00:00:00", "1-12", "1-02:30")] == \
        [600, 600, 14400, 172800, 129600, 95400]


def test_the_example_plan_times_every_evaluate_step_and_each_fits_its_jobs():
    from compass.flows.compiler import compile_spec
    from compass.flows.reports.plan_tables import evaluation_section
    from compass.flows.validation import load_checked
    from compass.specs.goodput_plan import predicted_splits
    from compass.tasks.evaluation.costs import evaluation_costs

    spec = load_checked(EXAMPLE, machine=False).spec
    costs = {c.step: c for c in evaluation_costs(spec)}
    assert set(costs) == {s.id for s in compile_spec(spec).steps if s.kind == "evaluate"}
    stage1 = next(s for s in predicted_splits(spec) if s.stage == "pretrain:stage1")
    assert costs["evaluate:pretrain-stage1"].checkpoints == -(-stage1.checkpoints // 10)  # every 10th exported (3B)
    assert all(c.fits and c.tokens > 1e7 for c in costs.values())
    # the benchmarks read what their items hold: MMLU 5-shot in MCF is most of it
    assert 3e7 < costs["evaluate:pretrain-stage1"].tokens < 1e8
    # a 4-hour job scores several checkpoints; stage 1's 173 take jobs in proportion
    one = costs["evaluate:pretrain-stage1"]
    assert one.jobs == pytest.approx(one.checkpoints / int(one.usable_s // one.per_checkpoint_s), abs=1)
    section = evaluation_section(spec)
    assert section is not None and section.columns[-1] == "fits 4:00:00"
    assert [r[0] for r in section.rows] == list(costs) and all(r[-1] == "yes" for r in section.rows)


def test_an_evaluation_time_limit_no_checkpoint_fits_in_is_refused_naming_the_steps(tmp_path: Path):
    from tests.test_scale_plan import refused_at

    text = EXAMPLE.read_text()
    given = 'evaluation: {devices_per_node: 1, time_limit: "4:00:00"}'
    assert given in text
    short = tmp_path / "smollm3-3b.yaml"
    short.write_text(text.replace(given, 'evaluation: {devices_per_node: 1, time_limit: "10:00"}'))
    refused_at(short, 'time_limit: "10:00"', r"how.resources.evaluation.time_limit: evaluate:pretrain-stage1, "
               r".*evaluate:post_train-apo: one checkpoint's evaluation takes ~\d+ min .* longer than .* 10:00 "
               r"\(10 min\).*set how.resources.evaluation.time_limit to at least 1:00:00")
