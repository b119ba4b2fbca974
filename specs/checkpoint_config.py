"""Reading a starting checkpoint (`what.model.init_from`) when the spec loads: where it is, a stamp of its files,
and its architecture in the spec's terms, from config.json alone (no weights, no transformers, no download).

The spec's own `what.architecture` is then optional; when it is written it must agree with the checkpoint on
every field that fixes the weights' shapes (`disagreements`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compass.specs.architecture import Architecture, MoE, Positions
from compass.specs.base import HintedError, Issue, Loc
from compass.specs.costs import count_parameters
from compass.specs.spec import TrainingSpec
from compass.specs.starting_model import ResolvedCheckpoint

TRAINABLE = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "smollm3")
SHAPE_FIELDS = ("family", "num_layers", "hidden_size", "ffn_size", "num_heads", "num_kv_heads", "head_dim",
                "vocab_size", "tied_embeddings", "qk_norm", "norm_eps")


@dataclass(frozen=True)
class CheckpointConfig:
    """A checkpoint's config.json and where it was read: `location` is the folder, the s3 URI or hf://repo."""

    config: dict[str, Any]
    location: str
    stamp: str


def read_checkpoint_config(init_from: str, revision: str | None, base_dir: Path) -> CheckpointConfig:
    """config.json of a hub id (local cache only), a folder (relative to the spec) or an s3:// URI; raises
    HintedError saying how to bring the checkpoint when it is not there."""
    if init_from.startswith("s3://"):
        if revision:
            raise HintedError("revision applies to hub ids, not to an s3:// prefix", "remove revision")
        return _from_s3(init_from)
    folder = (base_dir / Path(init_from).expanduser()).resolve()
    if folder.is_dir():
        if revision:
            raise HintedError("revision applies to hub ids, not to a folder", "remove revision")
        config = folder / "config.json"
        if not config.exists():
            raise HintedError(f"{folder} has no config.json", "point to a folder saved with save_pretrained()")
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        listing = [(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        return CheckpointConfig(_json(config.read_text(), str(config)), str(folder), _digest(listing))
    if init_from.startswith((".", "/", "~")) or init_from.count("/") > 1:
        raise HintedError(f"no folder '{init_from}' (relative to {base_dir})",
                          "give an existing folder, a hub id (org/name) or an s3:// URI")
    return _from_hub(init_from, revision)


def _from_hub(repo: str, revision: str | None) -> CheckpointConfig:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError

    try:
        path = Path(hf_hub_download(repo, "config.json", revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, EntryNotFoundError, HFValidationError, FileNotFoundError) as exc:
        raise HintedError(f"'{repo}'{f' at revision {revision}' if revision else ''} is not in the local Hugging "
                          f"Face cache ({type(exc).__name__})",
                          f"bring it with `hf download {repo}` where there is network, or give a folder") from None
    return CheckpointConfig(_json(path.read_text(), str(path)), f"hf://{repo}", path.parent.name)


def _from_s3(uri: str) -> CheckpointConfig:
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri.rstrip("/"))
    try:
        listing = fs.find(root, detail=True)
        text = fs.cat_file(f"{root}/config.json").decode()
    except (FileNotFoundError, OSError) as exc:
        raise HintedError(f"cannot read {uri}/config.json: {exc}",
                          "check the URI and the S3 credentials (AWS_* or the endpoint in the environment)") from None
    stamp = _digest(sorted((k, v.get("size"), str(v.get("ETag") or v.get("LastModified"))) for k, v in listing.items()))
    return CheckpointConfig(_json(text, f"{uri}/config.json"), uri.rstrip("/"), stamp)


def _json(text: str, where: str) -> dict[str, Any]:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise HintedError(f"{where} is not JSON: {exc}", "the checkpoint's config.json is damaged") from None


def _digest(rows: list[tuple[Any, ...]]) -> str:
    return "files:" + hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def context_length(config: dict[str, Any]) -> int:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return int(rope.get("original_max_position_embeddings") or config.get("max_position_embeddings") or 2048)


def rope_theta(config: dict[str, Any]) -> float:
    rope = config.get("rope_parameters") or {}
    return float(rope.get("rope_theta") or config.get("rope_theta") or 10_000.0)


def architecture_of(config: dict[str, Any]) -> Architecture:
    """The checkpoint's architecture in the spec's terms (what costs, plans and checks read)."""
    kind = config.get("model_type")
    if kind not in TRAINABLE:
        raise HintedError(f"model_type '{kind}' is not one compass trains",
                          f"start from one of: {', '.join(TRAINABLE)}")
    layers, heads, hidden = config["num_hidden_layers"], config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    positions = Positions(kind="rope", rope_theta=rope_theta(config))
    if kind == "smollm3":
        flags = config.get("no_rope_layers") or [1] * layers
        positions = _smollm3_positions(flags, positions.rope_theta)
    moe = None
    if kind == "qwen3_moe":
        moe = MoE(num_experts=config["num_experts"], experts_per_token=config["num_experts_per_tok"],
                  expert_ffn_size=config["moe_intermediate_size"],
                  load_balancing_coef=config.get("router_aux_loss_coef", 0.01))
    return Architecture(family="moe" if moe else "dense", num_layers=layers, hidden_size=hidden,
                        ffn_size=config["intermediate_size"], num_heads=heads,
                        num_kv_heads=config.get("num_key_value_heads") or heads,
                        head_dim=None if head_dim == hidden // heads else head_dim, vocab_size=config["vocab_size"],
                        positions=positions, tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                        qk_norm=kind in ("qwen3", "qwen3_moe"), norm_eps=config.get("rms_norm_eps", 1e-6),
                        init_std=config.get("initializer_range", 0.02), moe=moe)


def _smollm3_positions(flags: list[int], theta: float) -> Positions:
    """SmolLM3's per-layer RoPE flags as rope, nope, or rnope with a period (SmolLM3-3B: every 4th layer NoPE)."""
    if all(flags):
        return Positions(kind="rope", rope_theta=theta)
    if not any(flags):
        return Positions(kind="nope", rope_theta=theta)
    every = flags.index(0) + 1
    if every >= 2 and all((f == 0) == ((i + 1) % every == 0) for i, f in enumerate(flags)):
        return Positions(kind="rnope", rope_theta=theta, nope_every=every)
    raise HintedError("the checkpoint's no_rope_layers follow no period compass can express",
                      "compass plans rope, nope, or rnope with nope_every")


def disagreements(written: Architecture, checkpoint: Architecture) -> list[tuple[str, Any, Any]]:
    """(field, written, checkpoint) for each shape-fixing field the spec writes differently from the checkpoint
    (fields left to their defaults are the checkpoint's)."""
    out = []
    for name in (*SHAPE_FIELDS, "positions", "moe"):
        if name not in written.model_fields_set:
            continue
        mine, theirs = getattr(written, name), getattr(checkpoint, name)
        if name == "head_dim":
            mine, theirs = written.resolved_head_dim, checkpoint.resolved_head_dim
        elif name == "positions":
            mine, theirs = (mine.kind, mine.nope_every), (theirs.kind, theirs.nope_every)
        elif name == "moe":
            fields = ("num_experts", "experts_per_token", "expert_ffn_size")
            mine, theirs = ([getattr(m, f) for f in fields] if m else None for m in (mine, theirs))
        if mine != theirs:
            out.append((name, mine, theirs))
    return out


def merged(written: Architecture | None, checkpoint: Architecture) -> Architecture:
    """The checkpoint's architecture with what the spec writes on top (training options such as z_loss)."""
    if written is None:
        return checkpoint
    return checkpoint.model_copy(update={k: getattr(written, k) for k in written.model_fields_set})


def resolve_starting_model(spec: TrainingSpec, base_dir: Path) -> tuple[TrainingSpec, list[Issue]]:
    """The spec with `what.model.resolved` read from the checkpoint and `what.architecture` taken from it when the
    spec leaves it out; or the problems found (not there, not trainable, written architecture disagrees)."""
    model = spec.what.model
    if model is None:
        return spec, []
    at: Loc = ("what", "model")
    if "resolved" in model.model_fields_set:
        return spec, [Issue((*at, "resolved"), "resolved is filled in by compass when it loads the spec",
                            "remove what.model.resolved")]
    try:
        found = read_checkpoint_config(model.init_from, model.revision, base_dir)
        derived = architecture_of(found.config)
    except HintedError as exc:
        return spec, [Issue((*at, "init_from"), str(exc), exc.hint)]
    written = spec.what.architecture
    if written is not None:
        wrong = disagreements(written, derived)
        if wrong:
            return spec, [Issue(("what", "architecture", name), f"{name} is {mine} but the checkpoint "
                                f"{model.init_from} has {theirs}",
                                "remove what.architecture (it is read from the checkpoint) or make it agree")
                          for name, mine, theirs in wrong]
    resolved = _resolved(found, derived)
    what = spec.what.model_copy(update={"model": model.model_copy(update={"resolved": resolved}),
                                        "architecture": merged(written, derived)})
    return spec.model_copy(update={"what": what}), []


def resolve_named_models(spec: TrainingSpec, base_dir: Path) -> tuple[TrainingSpec, list[Issue]]:
    """The spec with each of `what.models` resolved like what.model (any causal LM kind: these only generate or
    teach), or the problems found."""
    issues: list[Issue] = []
    models = {}
    for name, model in spec.what.models.items():
        at: Loc = ("what", "models", name)
        if "resolved" in model.model_fields_set:
            issues.append(Issue((*at, "resolved"), "resolved is filled in by compass when it loads the spec",
                                f"remove what.models.{name}.resolved"))
            continue
        try:
            found = read_checkpoint_config(model.init_from, model.revision, base_dir)
        except HintedError as exc:
            issues.append(Issue((*at, "init_from"), str(exc), exc.hint))
            continue
        try:
            derived = architecture_of(found.config)
        except (HintedError, KeyError):
            derived = None  # a kind compass does not train: it can still answer prompts
        models[name] = model.model_copy(update={"resolved": _resolved(found, derived)})
    if issues:
        return spec, issues
    return spec.model_copy(update={"what": spec.what.model_copy(update={"models": models})}), []


def _resolved(found: CheckpointConfig, derived: Architecture | None) -> ResolvedCheckpoint:

    parameters = count_parameters(derived, derived.vocab_size).total if derived and derived.vocab_size else None
    return ResolvedCheckpoint(location=found.location, stamp=found.stamp,
                              model_type=str(found.config.get("model_type", "unknown")),
                              context_length=context_length(found.config), parameters=parameters)
