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


def quoted_in_prose(page: Path, pattern: str) -> str:
    """`quoted`, across the page's line breaks (each run of white space read as one space)."""
    found = re.findall(pattern, " ".join(page.read_text().split()))
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


def elided_match(quoted_line: str, printed: str) -> bool:
    """Whether a line the docs quote is the printed one, `...` standing for any text."""
    *fragments, last = quoted_line.split("...")
    if not fragments:
        return quoted_line == printed
    at = 0
    for i, fragment in enumerate(fragments):
        found = printed.find(fragment, at)
        if found < 0 or (i == 0 and found != 0):
            return False
        at = found + len(fragment)
    return printed.endswith(last) and len(printed) - len(last) >= at


def block_after(page: Path, first_line: str) -> list[str]:
    """The lines of the fenced block of `page` that starts with `first_line` (that line included)."""
    lines = page.read_text().splitlines()
    start = lines.index(first_line)
    end = lines.index("```", start)
    return lines[start:end]


def test_elided_match_reads_the_dots_as_any_text():
    assert elided_match("a (...) b", "a (x y) b") and not elided_match("a (...) b", "a (x y) c")
    assert elided_match("a (...)", "a (x (y))") and not elided_match("a (...) (...)", "a (x)")
    assert not elided_match("a b", "a b c") and not elided_match("b", "a b")


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_bad_spec_example_is_what_validate_prints(page: str):
    import subprocess

    from tests.conftest import VENV_BIN

    bad = "tests/bad_specs/several_errors_at_once.yaml"
    done = subprocess.run([str(VENV_BIN / "compass"), "validate", bad], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    printed = [line for line in done.stderr.splitlines() + done.stdout.splitlines() if line.startswith(bad + ":")]
    quoted_lines = [line for line in (REPO / page).read_text().splitlines() if line.startswith(bad + ":")]
    assert quoted_lines == printed


def test_the_plan_guide_shows_what_plan_prints_off_the_cluster(tmp_path: Path):
    """The offline `compass plan` of the SmolLM3 spec: no Hugging Face cache, no S3 credentials, no Slurm
    controller (the page once named line 134 and said "runs training")."""
    import os
    import subprocess

    from tests.conftest import VENV_BIN

    quoted_block = block_after(PLAN_GUIDE, "$ compass plan specs/examples/smollm3-3b.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SLURM_", "HF_", "PREFECT_"))}
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",  # Slurm: this machine's, with no controller
            "AWS_CONFIG_FILE": str(tmp_path / "aws-config"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws")}
    done = subprocess.run([str(VENV_BIN / "compass"), "plan", "specs/examples/smollm3-3b.yaml"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    printed = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    assert len(printed) == len(quoted_block) - 1, printed
    for quoted_line, line in zip(quoted_block[1:], printed, strict=True):
        assert elided_match(quoted_line, line), (quoted_line, line)


def test_the_plan_guide_quotes_the_smoke_tables_pretraining_row(smollm3):
    from compass.flows.reports.smoke import smoke_table
    from compass.specs.smoke import shrunk_spec

    small, changes = shrunk_spec(smollm3, "smoke")
    rows = {r["step"]: r for r in smoke_table(compile_spec(small), small, tuple(changes))}
    said = " ".join(quoted(PLAN_GUIDE, r"what it\s+exercised \(e\.g\. `([^`]+)`").split())
    assert said == rows["pretrain:stage1"]["exercised"]
    for shrink in " ".join(quoted(PLAN_GUIDE, r"what was shrunk \(`([^`]+)`").split()).split("; "):
        assert shrink in rows["pretrain:stage1"]["shrunk"], shrink


def test_the_floor_plan_names_every_step_kind_module():
    listed = quoted(REPO / "docs" / "development.md", r"`tasks/kinds/` \(one module per kind: ([^)]+)\)")
    listed = " ".join(listed.split())
    modules = {p.stem for p in (REPO / "tasks" / "kinds").glob("*.py") if p.stem != "__init__"}
    assert set(listed.split(", ")) == modules


def _default(model: type, field: str):
    return model.model_fields[field].default


def _defaults():
    from compass.specs.data import DataSource as Source
    from compass.specs.evaluation import Decontamination
    from compass.specs.how import Hardware, Monitoring, Storage

    return [
        ("docs/guides/plan-and-smoke.md", r"Llama 3's ([\d.]+) by default", float,
         _default(Hardware, "node_failures_per_day")),
        ("docs/guides/gpu-node.md", r"`how.monitoring.hang_timeout_s`, (\d+) minutes by default", lambda m: 60 * int(m),
         _default(Monitoring, "hang_timeout_s")),
        ("docs/guides/evaluation.md", r"`n_grams`, (\d+) by default", int, _default(Decontamination, "n_grams")),
        ("docs/guides/evaluation.md", r"`(\w+)` \(the default\) stops the run", str,
         _default(Decontamination, "policy")),
        ("docs/spec.md", r"`max_epochs` \(times training may read it over all stages; default (\d+)\)", float,
         _default(Source, "max_epochs")),
        ("docs/how-it-works.md", r"\((\d+) by default: token, document and curated shards", int,
         _default(Storage, "shard_index_above")),
        ("docs/guides/monitoring.md", r"`listen`\s+([\d.]+) by default", str, _default(Monitoring, "listen")),
    ]


@pytest.mark.parametrize(("page", "pattern", "read", "default"), _defaults(),
                         ids=lambda v: v if isinstance(v, str) and v.startswith("docs") else "")
def test_the_guides_quote_the_fields_defaults(page: str, pattern: str, read, default):
    assert read(quoted(REPO / page, pattern)) == default


def test_the_slurm_guide_quotes_smollm3s_cluster_plan(smollm3):
    """"pretraining 384 GPUs for ~25 days, long context 24 GPUs for ~10": summed from the planner's stages."""
    gpus, days, long_gpus, long_days = quoted(
        REPO / "docs" / "guides" / "slurm.md",
        r"pretraining (\d+) GPUs for ~(\d+) days, long context (\d+) GPUs for ~(\d+)\)")
    stages = costs.stage_costs(smollm3)
    for section, want_gpus, want_days in (("pretrain", gpus, days), ("long_context", long_gpus, long_days)):
        mine = [s for s in stages if s.section == section]
        assert {s.gpus for s in mine} == {int(want_gpus)}, section
        assert round(sum(s.wall_days for s in mine)) == int(want_days), section


def test_the_getting_started_page_shows_the_readmes_commands():
    """The commands at a glance, in two places: one list; every option it names is one its command has, and a value
    it shows (`--port 4200`) is that option's default."""
    import typer.main

    from compass.flows.cli.app import app
    from compass.flows.cli.reference import commands as cli_commands

    def commands(page: Path) -> list[str]:
        return block_after(page, next(line for line in page.read_text().splitlines()
                                      if line.startswith("compass validate SPEC")))

    listed = commands(REPO / "README.md")
    assert commands(REPO / "docs" / "getting-started.md") == listed
    listed_commands = list(cli_commands(typer.main.get_command(app)))
    options = {name: {o for p in command.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))}
               for name, command in listed_commands}
    defaults = {name: {o: p.default for p in command.params for o in p.opts} for name, command in listed_commands}
    for line in listed:
        usage = line.split("#")[0]
        name = max((n for n in options if usage.startswith(n + " ") or usage.strip() == n), key=len)
        for flag in re.findall(r"(--[a-z][a-z-]*)", usage):
            assert flag in options[name], (name, flag)
        for flag, value in re.findall(r"\[(--[a-z-]+) ([a-z0-9.]+)\]", usage):  # a literal value is the default
            assert str(defaults[name][flag]) == value, (name, flag, defaults[name][flag])


def _limits():
    import inspect

    from compass.flows.cli import app as cli
    from compass.flows.cli import ops as cli_ops
    from compass.infra.locks import StepLock
    from compass.specs import base, yaml_limits
    from compass.specs.data import DataSource
    from compass.tasks.data import source_files

    stale = inspect.signature(StepLock.__init__).parameters["stale_after_s"].default
    number = lambda text: float(text.replace(",", ""))  # noqa: E731
    return [
        (r"At most (\d+) MB \(`COMPASS_MAX_SPEC_BYTES`\)", lambda m: int(m) << 20, yaml_limits.MAX_BYTES),
        (r"(\d+) levels of nesting", int, yaml_limits.MAX_DEPTH),
        (r"([\d,]+) values after expanding", number, yaml_limits.MAX_NODES),
        (r"([\d,]+) characters per value", number, yaml_limits.MAX_SCALAR),
        (r"(\d+) digits per integer", int, yaml_limits.MAX_DIGITS),
        (r"no line over ([\d,]+) characters", number, yaml_limits.MAX_LINE),
        (r"are at most (\d+) characters, so artifact folders", int, base.NAME_MAX),
        (r"prints (\w+) problems per damaged", lambda m: {"ten": 10}[m], cli.VERIFY_SHOWN),
        (r"after (\d+) s without heartbeat", float, stale),
        (r"`max_document_chars` \((\d+)M by default\)", lambda m: int(m) * 1_000_000,
         DataSource.model_fields["max_document_chars"].default),
        (r"more than (\d+)% U\+FFFD", lambda m: int(m) / 100, source_files.MAX_REPLACEMENT_SHARE),
        (r"a password of (\d+) characters or more", int, cli_ops.MIN_PASSWORD),
    ]


@pytest.mark.parametrize(("pattern", "read", "value"), _limits(), ids=lambda v: v if isinstance(v, str) else "")
def test_trust_and_limits_quotes_the_limits_compass_enforces(pattern: str, read, value):
    assert read(quoted_in_prose(REPO / "docs" / "trust-and-limits.md", pattern)) == value


def _how_it_works():
    from compass.infra import shard_index, store
    from compass.model.training import token_files
    from compass.tasks.data import token_shards
    from compass.tasks.kinds import ingest, select_tokenizer

    return [
        (r"`<root>/<kind>/<name>-<fingerprint\[:(\d+)\]>/`", int,
         len(store.artifact_folder("k", "n", "f" * 64).split("-", 1)[1])),
        (r"batches of at most (\d+) documents", int, token_shards.BATCH),
        (r"documents / (\d+)M characters", lambda m: int(m) << 20, token_shards.BATCH_CHARS),
        (r"blocks of ~(\d+)M tokens", lambda m: int(m) << 20, token_files.FLUSH_TOKENS),
        (r"across up to (\d+) shards", int, select_tokenizer.SAMPLED_SHARDS),
        (r"one task per\s+GiB of input", lambda m: 1 << 30, ingest.TASK_BYTES),
        (r"or per (\d+) files", int, ingest.FILES_PER_TASK),
        (r"a fresh random sample of (\d+) per folder", int, shard_index.SAMPLE_PER_SET),
    ]


@pytest.mark.parametrize(("pattern", "read", "value"), _how_it_works(), ids=lambda v: v if isinstance(v, str) else "")
def test_how_it_works_quotes_the_sizes_compass_uses(pattern: str, read, value):
    assert read(quoted_in_prose(REPO / "docs" / "how-it-works.md", pattern)) == value


def _training_guide():
    import inspect

    from compass.infra import interrupt, net
    from compass.model.training import export_check
    from compass.model.training.packing import Prefetcher
    from compass.specs import costs

    words = {"two": 2, "2": 2}
    return [
        (r"a bounded queue of (\w+)\)", lambda m: words[m],
         inspect.signature(Prefetcher.__init__).parameters["depth"].default),
        (r"(\d+) MiB of fp32 logits at most", lambda m: int(m) << 20, costs.LOSS_CHUNK_BYTES),
        (r"tolerance \(([\de-]+) in fp32\)", float, export_check.TOLERANCE["fp32"]),
        (r"a free port between (\d+)", int, net.LOWEST),
        (r"exits (\d+) \(130 for Ctrl-C\)", int, interrupt.exit_code(RuntimeError())),
        (r"exits 143 \((\d+) for Ctrl-C\)", int, interrupt.exit_code(KeyboardInterrupt())),
    ]


@pytest.mark.parametrize(("pattern", "read", "value"), _training_guide(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_training_guide_quotes_the_numbers_compass_uses(pattern: str, read, value):
    assert read(quoted_in_prose(REPO / "docs" / "guides" / "training.md", pattern)) == value


def _evaluation_and_slurm_guides():
    import inspect

    from compass.flows.cli import preflight as cli_preflight
    from compass.infra import exits, shared_probe
    from compass.tasks.data import decontamination
    from compass.tasks.evaluation import retrieval

    evaluation, slurm = REPO / "docs" / "guides" / "evaluation.md", REPO / "docs" / "guides" / "slurm.md"
    words = {"four": 4}
    return [
        (evaluation, r"from (\d+) words on; shorter ones are counted as unmatchable", int, decontamination.SHORT_MIN),
        (evaluation, r"ranking the true key above (\w+) distractors \(chance (\d+)%\)",
         lambda m: (words[m[0]] + 1, 100 // int(m[1])), (retrieval.CANDIDATES, retrieval.CANDIDATES)),
        (evaluation, r"in (\d+)k-token passes beyond that", lambda m: int(m) * 1024, retrieval.PREFILL_CHUNK),
        (slurm, r"answers the same question for a (day)", lambda m: 24,
         shared_probe.SlurmCluster.model_fields["probe_valid_hours"].default),
        (slurm, r"writes why into the work folder and exits (\d+)", int, exits.RETRIABLE_EXIT),
        (slurm, r"\[--tolerance ([\d.]+)\]", float,
         inspect.signature(cli_preflight.preflight).parameters["tolerance"].default),
        (slurm, r"against (\d+)% of the data sheet's dense peak", lambda m: int(m) / 100, cli_preflight.ACHIEVABLE),
    ]


@pytest.mark.parametrize(("page", "pattern", "read", "value"), _evaluation_and_slurm_guides(),
                         ids=lambda v: v.name if isinstance(v, Path) else "")
def test_the_evaluation_and_slurm_guides_quote_the_numbers_compass_uses(page: Path, pattern: str, read, value):
    assert read(quoted_in_prose(page, pattern)) == value


def _smoke_sizes():
    from compass.specs import smoke

    return [
        (r"runs (\d+) optimizer steps or (\d+) samples", lambda m: tuple(map(int, m)), (smoke.STEPS, smoke.SAMPLES)),
        (r"keep their order \((\d+), ", int, smoke.SEQUENCE),
        (r"each source reads\s+(\d+) documents", int, smoke.DOCUMENTS),
    ]


@pytest.mark.parametrize(("pattern", "read", "value"), _smoke_sizes(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_plan_guide_quotes_the_smoke_sizes(pattern: str, read, value):
    assert read(quoted_in_prose(PLAN_GUIDE, pattern)) == value


def test_the_smoke_shrinks_moe_as_the_plan_guide_says(smollm3):
    """"MoE (4 experts at most, top-2)": what the shrinking does to a wider mixture of experts."""
    experts, top = quoted_in_prose(PLAN_GUIDE, r"MoE \((\d+) experts at most, top-(\d+)\)")
    from compass.specs.smoke import shrunk_spec

    arch = smollm3.what.architecture.model_dump()
    arch["moe"] = {"num_experts": 16, "experts_per_token": 4, "expert_ffn_size": 1024}
    wide = smollm3.model_copy(update={"what": smollm3.what.model_copy(update={
        "architecture": type(smollm3.what.architecture).model_validate(arch)})})
    small, _ = shrunk_spec(wide, "smoke")
    moe = small.what.architecture.moe
    assert (moe.num_experts, moe.experts_per_token) == (int(experts), int(top))


def test_the_monitoring_guide_quotes_the_alert_rules():
    """The thresholds the guide names are those of infra/observability/compass-alerts.rules.yml."""
    import yaml

    rules = {r["alert"]: r for group in yaml.safe_load(
        (REPO / "infra" / "observability" / "compass-alerts.rules.yml").read_text())["groups"] for r in group["rules"]}
    page = REPO / "docs" / "guides" / "monitoring.md"
    share, window, lasting = quoted_in_prose(page, r"throughput below (\d+)% of its own (\d+)-minute median for (\d+)")
    slow = rules["CompassThroughputDrop"]
    assert f"< {int(share) / 100} * quantile_over_time(0.5, compass_train_tokens_per_second[{window}m])" in \
        slow["expr"] and slow["for"] == f"{lasting}m"
    idle = int(quoted_in_prose(page, r"no step for (\d+) minutes \(a hung rank\)"))
    assert rules["CompassNoProgress"]["expr"].endswith(f"> {idle * 60}")
    straggler = int(quoted_in_prose(page, r"forward/backward (\d+)% slower than the median rank"))
    assert rules["CompassStraggler"]["expr"].strip().endswith(f"> {1 + straggler / 100}")
    hot = int(quoted_in_prose(page, r"a GPU above (\d+) C"))
    assert rules["CompassGpuHot"]["expr"] == f"compass_gpu_temperature_celsius > {hot}"
    waiting = int(quoted_in_prose(page, r"more than (\d+)% of step time waiting for data"))
    assert rules["CompassDataWait"]["expr"].strip().endswith(f"> {waiting / 100}")


def test_getting_started_describes_the_demo_spec():
    """The demo's shape as getting-started and the README tell it: the ablation, the stages' lengths, the
    long-context stages' lengths and RoPE bases, the decontamination's n-grams."""
    demo = load_spec(REPO / "specs" / "examples" / "tiny.yaml").spec
    page = REPO / "docs" / "getting-started.md"
    what = demo.what
    seeds = {"two": 2}[quoted_in_prose(page, r"embeddings, (\w+) seeds each\)")]
    assert len(what.ablations.seeds) == seeds
    assert [v.change for v in what.ablations.variants] == [{"architecture.tied_embeddings": False}]
    assert what.architecture.tied_embeddings  # "tied vs untied": the baseline ties them
    length = int(quoted_in_prose(page, r"SmolLM3-style model \((\d+) tokens\)"))
    assert {s.sequence_length for s in what.pretraining.stages} == {length} and len(what.pretraining.stages) == 2
    short, long_, base_short, base_long = quoted_in_prose(
        page, r"two long-context stages \((\d+) then (\d+) tokens, RoPE base (\d+)k then (\d+)k\)")
    stages = what.long_context.stages
    assert [(s.sequence_length, s.rope_theta) for s in stages] == [
        (int(short), int(base_short) * 1000), (int(long_), int(base_long) * 1000)]
    grams = int(quoted_in_prose(REPO / "README.md", r"every\s+benchmark item indexed as (\d+)-grams"))
    assert what.decontamination.n_grams == grams
