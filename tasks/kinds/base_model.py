"""The starting checkpoint (`what.model.init_from`) as the plan's first model: copied into the store as an
artifact with its tokenizer, so every later step (continued pretraining, mid-training, long context,
post-training, evaluation) reads it like any model this run trained, and its lineage names where it came from
(URI, revision, sha256 of the weights).

`what.models` are checkpoints from outside this run that steps name as `model:<name>` (the strong and weak
answerers of preference pairs, distillation teachers): each is a step of the `model` kind, copied the same way, so
the steps that read it find it on the shared store like any artifact. They are not models of this run: never
evaluated, never a `previous` or `final`.

The step's identity is the spec's `init_from` and `revision` plus the stamp read when the spec loaded (the hub
snapshot's commit, or the files' names, sizes and dates): a checkpoint replaced under the same name is copied
again, and the steps after it train again."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from compass.infra.fingerprint import weights_digest
from compass.infra.layout import TOKENIZER_FILES, ModelArtifact
from compass.specs.checkpoint_config import read_checkpoint_config
from compass.specs.spec import TrainingSpec
from compass.specs.starting_model import NAMED_MODEL_PREFIX
from compass.tasks.common.inputs import Gated, gates
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import TRANSFORMERS, NodeFile, PlanBuilder, StepKind
from compass.tasks.steps.placement import phase
from compass.tasks.steps.step_config import StepConfig

NOT_COPIED = ("*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.onnx", "*.gguf", ".cache", ".git*")


class BaseModelConfig(StepConfig):
    init_from: str
    revision: str | None
    stamp: str
    location: str  # where this machine reads it; not part of the identity (the stamp is)

    def identity(self) -> dict[str, Any]:
        data = super().identity()
        data.pop("location")
        return data


def build(plan: PlanBuilder) -> None:
    model = plan.spec.what.model
    if model is None:
        return
    if model.resolved is None:
        raise ValueError("what.model was not resolved: load the spec with compass.specs.loader")
    config = BaseModelConfig(init_from=model.init_from, revision=model.revision, stamp=model.resolved.stamp,
                             location=model.resolved.location)
    plan.add(KIND, "init", config, Gated(gates(plan)))


def build_named(plan: PlanBuilder) -> None:
    for name, model in plan.spec.what.models.items():
        if model.resolved is None:
            raise ValueError("what.models was not resolved: load the spec with compass.specs.loader")
        config = BaseModelConfig(init_from=model.init_from, revision=model.revision, stamp=model.resolved.stamp,
                                 location=model.resolved.location)
        plan.add(NAMED, name, config, Gated(gates(plan)))


def local_copy(location: str, stamp: str, scratch: Path) -> Path:
    """The checkpoint's folder on this machine: the hub cache's snapshot at the stamp's commit, the folder, or a
    download of the s3:// prefix into `scratch`."""
    if location.startswith("hf://"):
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(location.removeprefix("hf://"), revision=stamp, local_files_only=True))
    if location.startswith("s3://"):
        import fsspec

        fs, path = fsspec.core.url_to_fs(location)
        local = scratch / "checkpoint"
        fs.get(path.rstrip("/") + "/", str(local), recursive=True)
        return local
    return Path(location)


def node_files(spec: TrainingSpec) -> Iterator[NodeFile]:
    """A hub starting checkpoint's snapshot in the Hugging Face cache (where the data phase's job copies it from)."""
    model = spec.what.model
    if model is not None and model.resolved is not None and model.resolved.location.startswith("hf://"):
        with contextlib.suppress(OSError, ValueError):
            yield NodeFile(("what", "model", "init_from"), f"the starting checkpoint {model.init_from} in the "
                           "Hugging Face cache", local_copy(model.resolved.location, model.resolved.stamp, Path()))


def run_base_model(ctx: StepContext[BaseModelConfig]) -> StepResult:
    from compass.tasks.data.tokenizer_files import tokenizer_ids  # (transformers, when the step runs)

    cfg = ctx.config
    if not cfg.location.startswith("hf://"):  # a folder or prefix can change after the spec was loaded
        now = read_checkpoint_config(cfg.location, None, Path("/")).stamp
        if now != cfg.stamp:
            raise RuntimeError(f"{cfg.init_from} changed after the spec was loaded (its files differ): run again "
                               "so that the plan is made for the checkpoint as it is now")
    source = local_copy(cfg.location, cfg.stamp, ctx.scratch)
    if not list(source.glob("*.safetensors")):
        raise ValueError(f"{cfg.init_from} has no *.safetensors weights: convert it with save_pretrained("
                         "safe_serialization=True)")
    if not (source / "tokenizer.json").exists():
        raise ValueError(f"{cfg.init_from} has no tokenizer.json: compass trains with its fast tokenizer; save one "
                         "beside the weights")
    out = ModelArtifact(ctx.out)
    shutil.copytree(source, out.final, ignore=shutil.ignore_patterns(*NOT_COPIED))
    out.tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out.tokenizer / name)
    ids = tokenizer_ids(out.tokenizer)  # fails here, named, when the tokenizer lacks an end-of-text token
    config = json.loads((source / "config.json").read_text())
    weights = weights_digest(out.final)
    origin = {"model": cfg.init_from, "source": cfg.location, "revision": cfg.stamp, "weights_sha256": weights}
    metrics = {**origin, "model_type": config.get("model_type"), "vocab_size": ids.vocab_size,
               "max_position_embeddings": config.get("max_position_embeddings")}
    role = "starting checkpoint" if ctx.kind == KIND.name else f"model `{ctx.name}`"
    summary = (f"### {role} `{cfg.init_from}`\n\n{config.get('model_type')} from {cfg.location} at "
               f"`{cfg.stamp}`; weights sha256 `{weights[:16]}…`; tokenizer of {ids.vocab_size} ids")
    return StepResult(metrics=metrics, summary=summary, provenance=[origin])


KIND = StepKind("base_model", BaseModelConfig, run_base_model, build, version="1", resources=phase("data"),
                imports=TRANSFORMERS, node_files=node_files, inputs=Gated, after=("gate",),
                evaluated=True, advances_model=True, provides_tokenizer=True)
NAMED = StepKind(NAMED_MODEL_PREFIX.rstrip(":"), BaseModelConfig, run_base_model, build_named, version="1",
                 resources=phase("data"), imports=TRANSFORMERS, inputs=Gated, after=("gate",))
STEP_KINDS = (KIND, NAMED)
