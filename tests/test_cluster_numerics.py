"""The recipe's numerics on 2 bf16 ranks (issue 74, items 1-2): gradients summed over micro-batches and reduced
across the data-parallel ranks in fp32, as SmolLM3 and nanotron train. Before, DeepSpeed at ZeRO-0 in bf16 (the
SmolLM3 example's engine) ran its bf16 DDP optimizer: sums in bf16 `.grad` and a bf16 all-reduce, an error of one
bf16 rounding per sum that grows with the data-parallel size. The ranks (tests/numerics_ranks.py) read the dtype
the engines hand torch.distributed and the reduced gradient they hold, against a float64 sum of the same bf16
micro-batch gradients."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compass.flows.validation import load_checked
from compass.specs.loader import SpecError
from tests.conftest import REPO, write_minimal_spec

BF16_EPS = 2.0**-8  # bf16's relative rounding step: one 16-bit sum is off by up to half of it


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    from compass.infra.net import free_port

    out = tmp_path_factory.mktemp("numerics-ranks")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), "-m", "tests.numerics_ranks", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return {"0": reports[0], "1": reports[1]}


@pytest.mark.slow  # 2 DeepSpeed/FSDP2 ranks per engine: ~30 s of start-up
@pytest.mark.parametrize("setup", ["zero1", "zero2", "fsdp2"])
def test_bf16_gradients_are_summed_and_reduced_in_fp32(ranks: dict[str, dict], setup: str):
    for rank in ("0", "1"):
        report = ranks[rank][setup]
        assert report["engine_says"] == "accumulated in float32, reduced in float32", report
        assert report["held_in"] == ["float32"], report
        if setup != "fsdp2":  # FSDP2 reduce-scatters on gloo through its own all-reduce fallback: read its policy
            assert report["reduced_in"] == ["float32"], report
        assert report["parameters"] == 20
        # the fp32 sums match a float64 sum of the same bf16 micro-batch gradients to fp32's precision
        assert report["relative_error"] < 1e-6, report
    assert ranks["0"][setup]["relative_error"] == ranks["1"][setup]["relative_error"]  # one reduced gradient


@pytest.mark.slow  # reads the module's 2-rank runs
def test_a_bf16_reduction_is_what_the_test_would_see(ranks: dict[str, dict]):
    """The same measurement on the reduction compass ran before (DeepSpeed ZeRO-0, bf16): bf16 on the wire, bf16
    sums, an error of bf16's order. The fp32 check above would have failed on it."""
    report = ranks["0"]["zero0-bf16"]
    assert report["engine_says"] == "accumulated in bfloat16, reduced in bfloat16"
    assert report["reduced_in"] == ["bfloat16"] and report["held_in"] == ["bfloat16"]
    assert BF16_EPS / 100 < report["relative_error"] < BF16_EPS, report


@pytest.mark.slow  # reads the module's 2-rank runs
def test_the_norm_compass_reports_is_the_one_deepspeed_clips_with(ranks: dict[str, dict]):
    for setup in ("zero1", "zero2"):
        ours, deepspeeds = ranks["0"][setup]["norm"]
        assert ours == pytest.approx(deepspeeds, rel=1e-6), setup
        assert ranks["1"][setup]["norm"] == ranks["0"][setup]["norm"]


@pytest.mark.slow  # reads the module's 2-rank runs
def test_at_zero1_each_rank_writes_and_reads_only_its_share_of_the_optimizer_state(ranks: dict[str, dict]):
    """The SmolLM3 example's engine: the fp32 masters and AdamW's moments are split over the data-parallel ranks;
    each checkpoints its own share and a resumed rank loads only its own (at ZeRO-0 rank 0 wrote the whole state
    into the model file, and every rank read it)."""
    for rank in ("0", "1"):
        report = ranks[rank]["zero1"]
        optimizer_files = [f for f in report["wrote"] if "optim_states" in f]
        assert optimizer_files == [f"deepspeed/bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"], report
        assert [f for f in report["read"] if "optim_states" in f] == optimizer_files, report
    assert ranks["1"]["zero1"]["wrote"] == [f for f in ranks["1"]["zero1"]["wrote"] if "optim_states" in f]
    assert not [f for f in ranks["1"]["zero0-bf16"]["wrote"]]  # ZeRO-0: rank 0 writes everything


def spec_with(tmp_path: Path, how: str) -> Path:
    return write_minimal_spec(tmp_path, **{"how:\n  parallelism: {micro_batch_size: 2}\n": how})


GPU = "how:\n  hardware: {accelerator: h100}\n  precision: bf16\n  parallelism: {micro_batch_size: 2, ZERO}\n"


def test_fp32_reduction_at_deepspeed_zero0_is_refused_with_the_fix(tmp_path: Path):
    with pytest.raises(SpecError, match=r"how.parallelism.zero_stage.*ZeRO-0 sums and all-reduces bf16 gradients "
                                        r"in bf16.*use zero_stage: 1.*or reduce_precision: bf16"):
        load_checked(spec_with(tmp_path, GPU.replace("ZERO", "zero_stage: 0")), machine=False)
    load_checked(spec_with(tmp_path, GPU.replace("ZERO", "zero_stage: 1")), machine=False)
    low = GPU.replace("ZERO", "zero_stage: 0") + "  reduce_precision: bf16\n"
    load_checked(spec_with(tmp_path, low), machine=False)  # asked for: bf16 sums, said in the plan


def test_a_reduction_dtype_that_is_neither_fp32_nor_the_training_one_is_refused(tmp_path: Path):
    with pytest.raises(SpecError, match=r"how.reduce_precision: .*applies to bf16/fp16 training"):
        load_checked(spec_with(tmp_path, "how:\n  parallelism: {micro_batch_size: 2}\n  reduce_precision: bf16\n"),
                     machine=False)
    odd = GPU.replace("ZERO", "zero_stage: 1") + "  reduce_precision: fp16\n"
    with pytest.raises(SpecError, match=r"reduced in fp32 or in bf16, not in fp16"):
        load_checked(spec_with(tmp_path, odd), machine=False)


def test_the_field_reaches_the_training_steps_fingerprints_only(tmp_path: Path):
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec

    def fingerprints(how: str) -> dict[str, str]:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        return compile_spec(load_spec(spec_with(folder, how)).spec).fingerprints

    fp32 = fingerprints(GPU.replace("ZERO", "zero_stage: 1"))
    bf16 = fingerprints(GPU.replace("ZERO", "zero_stage: 1") + "  reduce_precision: bf16\n")
    changed = {name for name in fp32 if fp32[name] != bf16[name]}
    assert "pretrain:stage1" in changed, changed
    assert not any(n.startswith(("ingest", "curate", "tokenize", "evaluate")) for n in changed), changed


def test_the_plan_advises_no_stage_validation_refuses_and_counts_fp32_gradients_on_the_wire():
    """The SmolLM3 example reduces in fp32 (the recipe's), on DeepSpeed at ZeRO-1: the plan's sharding advice is
    ZeRO-1, not the ZeRO-0 that validation refuses with fp32 reduction, and its communication model sends 4 bytes a
    gradient (2 with reduce_precision: bf16, where ZeRO-0 is the advice again)."""
    from compass.flows.reports.plan_tables import sharding_advice
    from compass.specs import costs, scaling
    from compass.specs.loader import load_spec

    spec = load_spec(REPO / "specs" / "examples" / "smollm3-3b.yaml").spec
    device = costs.device_memory_bytes(spec.how)
    assert sharding_advice(spec, device) == ("recommended: ZeRO-1, the least sharding that fits and reduces in fp32 "
                                             "(DeepSpeed's ZeRO-0 reduces bf16 gradients in bf16); the spec's choice")
    bf16 = spec.model_copy(update={"how": spec.how.model_copy(update={"reduce_precision": "bf16"})})
    assert sharding_advice(bf16, device).startswith("recommended: no sharding (ZeRO-0 / DDP), the least sharding")
    assert scaling.reduced_bytes(spec) == 4 and scaling.reduced_bytes(bf16) == 2

    def slow_network(s):  # a network slow enough that the all-reduce shows past the backward pass
        hw = s.how.hardware.model_copy(update={"internode_busbw_gbps": 1.0})
        return s.model_copy(update={"how": s.how.model_copy(update={"hardware": hw})})

    _, fp32_exposed, _ = scaling.wall_days(slow_network(spec), 384)
    _, bf16_exposed, _ = scaling.wall_days(slow_network(bf16), 384)
    assert fp32_exposed > bf16_exposed > 0
