"""`--rehearse`: the SmolLM3 spec with `what` shrunk as smoke mode shrinks it and `how` kept (compass.specs.smoke),
and the trainer's CUDA-only kernels on a GPU spec's CPU ranks. The run itself on the emulated cluster:
tests/test_production.py::test_the_production_spec_rehearses_its_pretraining_on_two_gpu_nodes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from compass.flows.reports.step_record import StepRecord
from tests.conftest import REPO, VENV_BIN
from tests.hub_cache import llama_like_tokenizer, seed_model

SPEC = REPO / "specs" / "examples" / "smollm3-3b.yaml"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer the spec names, in a Hugging Face cache of its own."""
    folder = tmp_path_factory.mktemp("hub")
    seed_model(folder / "hub", "meta-llama/Llama-3.2-1B", llama_like_tokenizer(folder / "tokenizer"))
    return folder / "hub"


def checked(size: str, hub_cache: Path, monkeypatch: pytest.MonkeyPatch):
    from compass.flows.validation import load_checked

    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    return load_checked(SPEC, machine=False, size=size)


def test_a_rehearsal_keeps_how_and_caps_its_shapes_at_two_nodes_of_two_gpus(hub_cache: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    from compass.specs import load_spec

    real = load_spec(SPEC).spec.how
    rehearsal = checked("rehearsal", hub_cache, monkeypatch)
    spec, how = rehearsal.spec, rehearsal.spec.how
    assert spec.name == "smollm3-3b-rehearsal" and how.storage.root == real.storage.root + "-rehearsal"
    kept = {"accelerator": how.hardware.accelerator, "precision": how.precision, "loss": how.loss,
            "attention": how.attention, "engine": how.parallelism.engine_name, "zero": how.parallelism.zero_stage,
            "tp": how.parallelism.tensor_parallel, "micro": how.parallelism.micro_batch_size,
            "checkpointing": how.parallelism.activation_checkpointing, "cluster": how.orchestration.cluster,
            "retries": how.orchestration.retries, "cache": how.storage.local_cache,
            "reduce": how.reduce_precision}
    assert kept == {"accelerator": "h100", "precision": "bf16", "loss": "liger", "attention": real.attention,
                    "reduce": "fp32", "engine": "deepspeed", "zero": 1, "tp": 2, "micro": 3, "checkpointing": True,
                    "cluster": real.orchestration.cluster, "retries": 3, "cache": "/scratch/compass"}
    shapes = {phase: (how.shape(phase).nodes, how.shape(phase).devices_per_node)
              for phase in ("pretraining", "long_context", "ablation", "post_training", "evaluation")}
    assert shapes == {"pretraining": (2, 2), "long_context": (2, 2), "ablation": (1, 2), "post_training": (1, 2),
                      "evaluation": (1, 1)}
    assert how.parallelism.data_parallel == 2  # 4 GPUs over TP 2
    for stage in spec.what.pretraining.stages:  # two micro-batches of 3 rows on each of 2 replicas
        assert stage.global_batch_size == 12 and stage.tokens == 4 * 12 * stage.sequence_length
    for stage in spec.what.long_context.stages:
        micro = stage.micro_batch_size or how.parallelism.micro_batch_size
        assert stage.global_batch_size == 2 * micro * how.data_parallel("long_context")
    smoke = checked("smoke", hub_cache, monkeypatch)
    data = [s.id for s in rehearsal.plan.steps if s.kind in ("ingest", "curate", "tokenizer", "tokenize")]
    assert len(data) == 19  # the smoke run's data steps, the same fingerprints: a rehearsal can reuse them
    assert all(rehearsal.plan.fingerprints[s] == smoke.plan.fingerprints[s] for s in data)
    assert rehearsal.plan.fingerprints["pretrain:stage1"] != smoke.plan.fingerprints["pretrain:stage1"]
    changed = {(c.section, c.field) for c in rehearsal.loaded.size_changes if c.section.startswith("how")}
    assert changed == {("how.hardware", "nodes"), ("how.hardware", "devices_per_node"),
                       ("how.resources.long_context", "nodes"), ("how.resources.post_training", "devices_per_node"),
                       ("how.parallelism", "data_parallel"), ("how.checkpoints", "every_steps"),
                       ("how.storage", "root")}
    from compass.flows.reports.smoke import smoke_table

    rows = {r["step"]: r for r in smoke_table(rehearsal.plan, spec, rehearsal.loaded.size_changes, "rehearsal")}
    for step in ("pretrain:stage1", "mid_training:reasoning_mid"):  # compass's trainer, on the phase's shape
        assert rows[step]["exercised"].startswith("DeepSpeed ZeRO-1 + TP 2 in bf16 on 4 ranks over 2 node(s) x 2 "
                                                  "h100 (Slurm, launch srun)"), rows[step]
    assert "batch_size 576 -> 12" in rows["mid_training:reasoning_mid"]["shrunk"]


def test_smoke_and_rehearse_together_are_refused():
    done = subprocess.run([str(VENV_BIN / "compass"), "validate", str(SPEC), "--smoke", "--rehearse"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--smoke and --rehearse exclude each other" in done.stderr


def test_a_gpu_specs_cpu_rank_replaces_only_cuda_only_kernels_and_says_so(stage1_job, tmp_path: Path):
    from compass.model.training.trainer import cpu_rank_kernels

    job = stage1_job(tmp_path)
    gpu = job.with_how(hardware=job.hardware.model_copy(update={"accelerator": "h100"}), loss="liger",
                       attention="flash")
    on_cpu, said = cpu_rank_kernels(gpu, cuda=False)
    assert (on_cpu.loss, on_cpu.attention) == ("chunked", "varlen")
    assert said == ["attention flash -> varlen (a GPU rank's varlen kernels need CUDA: their per-document reference, "
                    "fed the same lengths)", "loss liger -> chunked (Liger's fused kernel needs CUDA)"]
    flex, said = cpu_rank_kernels(gpu.with_how(attention="flex", loss="auto"), cuda=False)
    assert flex.attention == "sdpa" and said == ["attention flex -> sdpa (FlexAttention has no backward pass on CPU "
                                                 "in this torch: it trains on CUDA only)"]
    assert cpu_rank_kernels(gpu, cuda=True) == (gpu, [])  # a GPU rank keeps them (and fails without the extras)
    kept = gpu.with_how(loss="auto", attention="sdpa")
    assert cpu_rank_kernels(kept, cuda=False) == (kept, [])  # nothing CUDA-only: nothing said


def test_a_gpu_specs_trl_ranks_on_the_cpu_take_trls_own_loss_instead_of_liger():
    """Found by the SmolLM3 spec's whole rehearsal on the emulated cluster: its SFT ranks (CPU) asked TRL for Liger
    (loss: liger) and failed in transformers' apply_liger_kernel."""
    from compass.specs.how import How
    from compass.tasks.post_training.trl_ranks import uses_liger

    liger = How.model_validate({"hardware": {"accelerator": "h100"}, "precision": "bf16", "loss": "liger"})
    assert uses_liger(liger, "cuda") and not uses_liger(liger, "cpu")
    assert not uses_liger(How.model_validate({"loss": "auto"}), "cpu")


def test_a_rehearsals_library_steps_keep_bf16_and_say_what_their_cpu_ranks_replaced(
        hub_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """TRL and lighteval compute in the spec's bf16 on a rank without CUDA (issue 74 item 5: before, fp32 there, so
    the bf16 path first ran on the cluster); what they do replace there (flash-attn, which needs CUDA, by SDPA) a GPU
    spec's post-training and evaluation steps record in their manifests (`setup.substituted`), and the rehearsal's
    table says it on their rows, as it says the trainer's kernel substitutions. A smoke run (accelerator cpu)
    computes in fp32 and substitutes nothing."""
    import torch

    from compass.flows.reports.smoke import smoke_table
    from compass.infra.store import Store
    from compass.tasks.common.devices import cpu_substitutions, setup_of
    from tests.test_store import manifest_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a rehearsal's CPU node, on any machine
    rehearsal = checked("rehearsal", hub_cache, monkeypatch)
    flash = rehearsal.spec.how.model_copy(update={"attention": "flash"})
    replaced = ["attention flash -> sdpa (a library's model on a CPU rank: flash-attn needs CUDA)"]
    assert cpu_substitutions(flash) == replaced and cpu_substitutions(rehearsal.spec.how) == []
    assert cpu_substitutions(checked("smoke", hub_cache, monkeypatch).spec.how.model_copy(
        update={"attention": "flash"})) == []

    from compass.model.training.rank_device import REHEARSAL_ENV

    monkeypatch.setenv(REHEARSAL_ENV, "1")  # as in the rehearsal's jobs: a GPU spec's step here computes on the CPU
    assert setup_of(rehearsal.spec.how) == {"device": "cpu", "precision": "bfloat16", "substituted": []}
    assert setup_of(flash) == {"device": "cpu", "precision": "bfloat16", "substituted": replaced}
    store = Store(str(tmp_path / "store"))
    results = []
    for step_id in ("post_train:apo", "evaluate:pretrain-stage3"):
        kind, name = step_id.split(":")
        manifest = manifest_for(store, kind, name, rehearsal.plan.fingerprints[step_id],
                                metrics={"setup": setup_of(flash)})
        with store.staging() as out:
            store.commit(out, manifest)
        results.append(StepRecord(step=step_id, uri=manifest.uri, executed=True, seconds=1.0, pid=1))
    rows = {r["step"]: r for r in smoke_table(rehearsal.plan, rehearsal.spec, rehearsal.loaded.size_changes,
                                              "rehearsal", results, store)}
    for step_id in ("post_train:apo", "evaluate:pretrain-stage3"):
        said = rows[step_id]["exercised"]
        assert said.endswith("; on CPU ranks: " + "; ".join(replaced)), said
    assert "on CPU ranks" not in rows["post_train:sft"]["exercised"]  # no manifest read: nothing said
