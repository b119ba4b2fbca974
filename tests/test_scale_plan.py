"""The plan's per-step scale table (issue 73, build item 2): at the SmolLM3 example's full size, each training stage
and evaluate step with the jobs it takes under its time limit, what each node stages, what it reads, writes in
checkpoints, commits and uploads to S3, each limit held; what grows grows with what the step does (its tokens, the
checkpoints it scores), and a stage whose jobs could never save progress is refused at validation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.conftest import REPO

EXAMPLE = REPO / "specs" / "examples" / "smollm3-3b.yaml"


def example(tmp_path: Path, **replacements: str) -> Path:
    text = EXAMPLE.read_text()
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "smollm3-3b.yaml"
    path.write_text(text)
    return path


def refused_at(path: Path, marker: str, message: str) -> None:
    """Validation refuses `path` with `message` at the line holding `marker`, and writes nothing beside it."""
    from compass.flows.validation import load_checked
    from compass.specs.loader import SpecError

    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if marker in t)
    with pytest.raises(SpecError, match=rf"{path.name}:{line}: {message}"):
        load_checked(path, machine=False)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # nothing written


def scales(path: Path):
    from compass.flows.reports.phase_scale import phase_scales
    from compass.flows.validation import load_checked

    spec = load_checked(path, machine=False).spec
    return spec, {p.step: p for p in phase_scales(spec)}


def test_the_example_plan_prints_every_step_at_full_size_each_fitting_its_jobs():
    from compass.flows.compiler import compile_spec
    from compass.flows.reports.plan_tables import scale_section
    from compass.model.training.heldout_sample import SAMPLE_TOKENS
    from compass.specs.costs import count_parameters, planning_vocab
    from compass.specs.goodput_plan import predicted_splits

    spec, rows = scales(EXAMPLE)
    trained = {s.id for s in compile_spec(spec).steps
               if s.kind in ("pretrain", "long_context", "mid_training", "evaluate")}
    assert set(rows) == trained and all(p.fits_job for p in rows.values())
    params = count_parameters(spec.what.architecture, planning_vocab(spec)).total
    split = next(s for s in predicted_splits(spec) if s.stage == "pretrain:stage1")
    stage1 = rows["pretrain:stage1"]
    # bf16 weights, fp32 master weights and AdamW's two moments at every one of stage 1's checkpoints
    assert stage1.checkpoint_bytes == split.checkpoints * params * 14
    assert stage1.read == 0 and rows["pretrain:stage2"].read == params * 16  # the state and export it continues
    assert stage1.uploaded == stage1.checkpoint_bytes + stage1.artifact_bytes  # the store is on S3
    # a 2-day limit less start-up and the stop signal's lead: 18 days take 10 jobs, 3.5 interruptions 4 more
    usable = 2 * 86400 - spec.how.hardware.startup_estimate_s - spec.how.stop_lead_s
    assert stage1.jobs == math.ceil(split.total_s / usable) + math.ceil(split.interruptions)
    # an evaluation reads the exports it scores and a fixed held-out sample of each perplexity source
    evaluation = rows["evaluate:pretrain-stage1"]
    exports = math.ceil(split.checkpoints / 10)
    assert evaluation.read == exports * params * 2 + 2 * SAMPLE_TOKENS * 4
    section = scale_section(spec)
    assert section is not None and [r[0] for r in section.rows] == list(rows)
    assert all(r[-1] == "yes" for r in section.rows)


def test_what_a_step_costs_grows_with_its_own_tokens_and_not_with_anything_else(tmp_path: Path):
    """Stage 1 drawing twice the tokens: its checkpoints, its nodes' copies and its evaluation's reads double (the
    held-out sample stays), and the later stages' rows do not move."""
    _, base = scales(EXAMPLE)
    _, double = scales(example(tmp_path, **{"tokens: 8.1396e12": "tokens: 16.2792e12"}))
    ratio = {k: double["pretrain:stage1"].__getattribute__(k) / base["pretrain:stage1"].__getattribute__(k)
             for k in ("checkpoint_bytes", "staged_per_node", "wall_s")}
    assert ratio == pytest.approx({"checkpoint_bytes": 2, "staged_per_node": 2, "wall_s": 2}, rel=0.01)
    assert double["evaluate:pretrain-stage1"].read / base["evaluate:pretrain-stage1"].read == pytest.approx(2, rel=0.02)
    assert double["pretrain:stage3"] == base["pretrain:stage3"]


def test_a_stage_whose_jobs_end_before_its_first_checkpoint_is_refused_naming_it(tmp_path: Path):
    """Without the stop signal (requeue: false) a job saves only every every_steps: 2,000 steps of stage 1 take
    ~15 min, 200,000 take a day, longer than a 10-hour job."""
    path = example(tmp_path, **{"requeue: true, signal_before_s: 300}": "requeue: false}",
                                'time_limit: "2-00:00:00"': 'time_limit: "10:00:00"',
                                "checkpoints: {every_steps: 2000,": "checkpoints: {every_steps: 200000,"})
    refused_at(path, "every_steps: 200000", r"how.checkpoints.every_steps: pretrain:stage1 saves a checkpoint "
               r"every ~\d+\.\d h \(200,000 steps\), longer than .* 10:00:00 time limit.*no job would commit "
               r"progress.*every_steps to at most [\d,]+, or requeue: true")
    # the same spec with the stop signal saves before each limit, whatever the cadence
    _, rows = scales(example(tmp_path / "signalled", **{'time_limit: "2-00:00:00"': 'time_limit: "10:00:00"',
                                             "checkpoints: {every_steps: 2000,": "checkpoints: {every_steps: 200000,"}))
    assert rows["pretrain:stage1"].fits_job and rows["pretrain:stage1"].jobs > 40  # 18 days in 10-hour jobs


def test_the_plan_guide_quotes_the_scale_table():
    from tests.test_newcomer_docs_numbers import PLAN_GUIDE, quoted_in_prose

    spec, rows = scales(EXAMPLE)
    stage1 = rows["pretrain:stage1"]
    tib, checkpoints, gb = quoted_in_prose(PLAN_GUIDE, r"stage 1 writes ~(\d+) TiB of checkpoints over 18 days "
                                                       r"\(([\d,]+) of ~(\d+) GB\)")
    assert int(tib) == round(stage1.checkpoint_bytes / 2**40)
    assert int(checkpoints.replace(",", "")) * int(gb) * 1e9 == pytest.approx(stage1.checkpoint_bytes, rel=0.01)
    assert round(stage1.wall_s / 86400) == 18
    assert int(quoted_in_prose(PLAN_GUIDE, r"commits ~(\d+) TiB \(its kept")) == round(stage1.artifact_bytes / 2**40)


def test_a_training_time_limit_shorter_than_the_start_up_and_the_stop_lead_is_refused(tmp_path: Path):
    """A 4-minute limit with a 5-minute stop signal and 3 minutes of start-up: every job would be asked to stop
    before it trained a step (the table said "fits its jobs: NO"; validation let it through)."""
    path = example(tmp_path, **{'time_limit: "2-00:00:00"': 'time_limit: "4:00"'})
    refused_at(path, 'time_limit: "4:00"', r"how.orchestration.cluster.time_limit: pretrain:stage1: its jobs' time "
               r"limit 4:00 leaves no time to train after the start-up \(~180 s, how.hardware.startup_s\) and the "
               r"stop signal's lead \(300 s\).*give the phase a longer time limit")
