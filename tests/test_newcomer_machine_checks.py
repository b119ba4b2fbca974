"""`--no-machine-checks` checks a spec alone (issue 45, item 6): the SmolLM3 example validates and plans on a laptop
that has neither its Slurm cluster nor its hub tokenizer (the declared vocabulary size plans), while what this
compass accepts (a datatrove filter's parameters) is still checked; with machine checks, the missing tokenizer is a
located error. Exit codes: 0 valid, 2 problems, nothing written."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import REPO, VENV_BIN, write_minimal_spec

EXAMPLE = REPO / "specs" / "examples" / "smollm3-3b.yaml"


def compass(*args: str, cache: Path) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(VENV_BIN / "compass"), *args], capture_output=True, text=True, env=env, cwd=cache.parent,
                          timeout=300)


def test_a_cluster_spec_checks_and_plans_alone_off_its_cluster_without_its_hub_tokenizer(tmp_path: Path):
    empty = tmp_path / "hub-cache"
    empty.mkdir()
    alone = compass("validate", str(EXAMPLE), "--no-machine-checks", cache=empty)
    assert alone.returncode == 0, alone.stderr
    assert "ok" in alone.stdout and "'smollm3-3b'" in alone.stdout
    planned = compass("plan", str(EXAMPLE), "--no-machine-checks", "--json", cache=empty)
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["spec"] == "smollm3-3b"

    checked = compass("validate", str(EXAMPLE), cache=empty)
    assert checked.returncode == 2
    assert "what.tokenizer.candidates[0].repo: the tokenizer 'meta-llama/Llama-3.2-1B'" in checked.stderr
    assert "runs its steps as Slurm jobs" in checked.stderr and "nothing was run or written" in checked.stderr
    assert not list(tmp_path.glob("**/manifest.json"))


def test_what_this_compass_accepts_is_checked_without_machine_checks(tmp_path: Path):
    from compass.flows.validation import load_checked
    from compass.specs.loader import SpecError

    spec = write_minimal_spec(tmp_path, **{"params: {min_doc_words: 20}": "params: {min_doc_wordz: 20}"})
    try:
        load_checked(spec, machine=False)
    except SpecError as refused:
        (problem,) = refused.problems
    else:
        raise AssertionError("a filter parameter datatrove does not take was accepted")
    assert problem.path == "what.data.sources[0].curation.filters[1].params.min_doc_wordz"
    assert "has no parameter 'min_doc_wordz'" in problem.message and "min_doc_words" in problem.hint
