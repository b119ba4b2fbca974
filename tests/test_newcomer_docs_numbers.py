"""Numbers the docs quote are the code's (issue 45, item 12): each is read from its page and computed again, so a
page that drifts from what compass does fails here (the README once counted 57 malformed specs of 65, and the plan
guide 41 steps of 44)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from compass.flows.compiler import compile_spec
from compass.specs import costs, load_spec
from tests.conftest import REPO

PLAN_GUIDE = REPO / "docs" / "guides" / "plan-and-smoke.md"


def quoted(page: Path, pattern: str) -> str:
    """The one number `pattern` captures on `page`."""
    found = re.findall(pattern, page.read_text())
    assert len(found) == 1, f"{page.relative_to(REPO)}: expected one match of {pattern!r}, found {found}"
    return found[0]


@pytest.fixture(scope="module")
def smollm3():
    return load_spec(REPO / "specs" / "examples" / "smollm3-3b.yaml").spec


def test_the_readme_counts_the_malformed_specs():
    count = int(quoted(REPO / "README.md", r"holds (\d+) malformed specs"))
    assert count == len(list((REPO / "tests" / "bad_specs").glob("*.yaml")))


def test_the_plan_guide_quotes_smollm3s_plan(smollm3):
    assert int(quoted(PLAN_GUIDE, r"prints the DAG \((\d+) steps\)")) == len(compile_spec(smollm3).steps)
    parameters = costs.count_parameters(smollm3.what.architecture, smollm3.what.architecture.vocab_size)
    assert int(quoted(PLAN_GUIDE, r"SmolLM3-3B has ([\d,]+);").replace(",", "")) == parameters.total
    hours = sum(s.gpu_hours for s in costs.stage_costs(smollm3) if s.section in ("pretrain", "long_context"))
    assert int(quoted(PLAN_GUIDE, r"~(\d+)k H100-hours")) == round(hours / 1000)


def test_the_plan_guide_quotes_smollm3s_scaling(smollm3):
    """The GPU-count paragraph (it once said 25.5 days and 384 GPUs for a 26-day target; the planner says 25.0 and
    376)."""
    from compass.specs import scaling

    days, _, _ = scaling.wall_days(smollm3, 384)
    assert float(quoted(PLAN_GUIDE, r"it gives ([\d.]+) days on 384 H100s")) == round(days, 1)
    gpus, target = quoted(PLAN_GUIDE, r"(\d+) GPUs for a (\d+)-day\s+target")
    assert int(gpus) == scaling.gpus_for(smollm3, float(target))
    batch = int(quoted(PLAN_GUIDE, r"the global batch \((\d+) sequences"))
    assert batch == smollm3.what.pretraining.stages[0].global_batch_size
