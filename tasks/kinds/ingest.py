"""Ingest: turn a raw source (package, local folder, s3 prefix) into datatrove documents (JSONL shards in zstd).

A datatrove pipeline (tasks/data/source_reader.SourceReader -> a reproducible JSONL shard writer) run by the executor
the step's placement names, like every data step: each task reads a contiguous group of the source's files, as
streams, and writes one shard. How many tasks comes from the data and the spec: one per TASK_BYTES of input, at
least the data phase's CPUs (how.resources.data), at most one per file. The stage's completion markers live in
the step's work folder, so a relaunch redoes only the tasks that did not complete. stats.json records each
shard's documents and characters (the ranks' own counts).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import platform
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from compass.infra.errors import DataError
from compass.infra.layout import DOCUMENTS, SHARD_SUFFIX
from compass.infra.packages import fetch_package
from compass.infra.store import Store
from compass.specs.base import Issue
from compass.specs.sources import parse_source_uri, source_holding
from compass.specs.spec import TrainingSpec
from compass.tasks.data.datatrove_stages import rank_block_stats, run_stage
from compass.tasks.data.source_check import record_problem
from compass.tasks.data.source_files import MAX_DOCUMENT_CHARS, MAX_REPLACEMENT_SHARE, ReadSettings, drop_reason
from compass.tasks.post_training.reasoning import trace_documents
from compass.tasks.steps.context import StepContext, StepResult
from compass.tasks.steps.kind import PlanBuilder, StepKind
from compass.tasks.steps.placement import phase
from compass.tasks.steps.step_config import StepConfig

TASK_BYTES = 1 << 30  # input bytes a task reads at most, where the files allow (a file is never split)
FILES_PER_TASK = 500  # and files: a source of many small files (a page or a code file each) still fans out


class IngestConfig(StepConfig):
    """Where the raw files are and how they become documents (curation is the next step's)."""

    omit_when_none = frozenset({"python", "listing"})

    uri: str
    include: list[str]
    exclude: list[str]
    format: Literal["jsonl", "parquet", "text", "html", "code", "warc"]
    text_key: str
    split: Literal["file", "sections"]
    section_chars: int
    language: str | None
    domain: str
    max_documents: int | None
    max_document_chars: int = MAX_DOCUMENT_CHARS
    python: str | None = None  # stdlib:// sources: the standard library differs between Python versions
    listing: str | None = None  # the source's files: a local folder's or an s3:// prefix's (specs/input_stamps.py)


def build(plan: PlanBuilder) -> None:
    for src in plan.spec.what.data.sources:
        fields = src.model_dump(mode="json", include=set(IngestConfig.model_fields) - {"python"})
        python = platform.python_version() if src.uri.startswith("stdlib://") else None
        plan.add(KIND, src.name, IngestConfig(**fields, python=python))


def check_machine(spec: TrainingSpec, base_dir: Path) -> Iterator[Issue]:
    """A local source must exist on this machine, its records (jsonl, parquet) must read as its ingest reads them
    (tasks/data/source_check.py), and it must not hold the store (the store's manifests, locks and shards would be
    the source's next documents)."""
    for i, src in enumerate(spec.what.data.sources):
        uri = parse_source_uri(src.uri)
        if uri.scheme != "file":
            continue
        folder = (base_dir / uri.path).expanduser()
        if not folder.exists():
            yield Issue(("what", "data", "sources", i, "uri"),
                        f"local source '{uri.path}' does not exist (relative to {base_dir})",
                        "fix the path, or use s3://, deb://, pypi:// or stdlib://")
        elif src.format in ("jsonl", "parquet"):
            fs, root = _local_fs(), str(folder.resolve())
            files = list(_select(fs, root, src.include, src.exclude).files)
            problem = record_problem(fs, root, files, src.format, src.text_key, src.max_document_chars)
            if problem is not None:
                yield Issue(("what", "data", "sources", i, "uri"), problem.message, problem.hint)
    root = spec.how.storage.root_at(base_dir)
    holder = source_holding(spec.what.data.sources, base_dir, root)
    if holder:
        store = Path(root.removeprefix("file://")).expanduser().resolve()
        yield Issue(("how", "storage", "root"), f"the store {store} lies inside the local source '{holder[0]}' "
                    f"({holder[1]})", "put the store outside the source folder")


def run_ingest(ctx: StepContext[IngestConfig]) -> StepResult:
    cfg = ctx.config
    uri = parse_source_uri(cfg.uri)
    provenance: dict
    if uri.scheme == "traces":  # generated: no files to select

        documents, provenance = trace_documents(uri.path, ctx.name, cfg.domain)
        return _write_generated(ctx, documents, provenance)
    if uri.is_package:
        root, provenance = fetch_package(uri)
        if uri.scheme == "stdlib" and uri.path:
            root = root / uri.path
        fs, base = _local_fs(), str(root)
    elif uri.scheme == "s3":
        import fsspec

        fs, base = fsspec.core.url_to_fs(uri.path)
        base = fs.unstrip_protocol(base)
        provenance = {"kind": "s3", "uri": uri.path}
    else:
        path = (ctx.runtime.base_dir / uri.path).expanduser().resolve()
        fs, base = _local_fs(), str(path)
        provenance = {"kind": "local", "path": str(path)}
    selection = _select(fs, base.rstrip("/"), cfg.include, cfg.exclude, ctx.store)
    files = selection.files
    if selection.left_out:
        ctx.log.warning("ingest %s: left out %d files: %s", ctx.name, len(selection.left_out),
                        "; ".join(f"{k} ({v})" for k, v in list(selection.left_out.items())[:5]))
    if not files:
        where = cfg.uri if uri.scheme == "s3" else base
        raise DataError(f"source {ctx.name}: no files under {where} match include={cfg.include} "
                         f"exclude={cfg.exclude} (check the URI and the include patterns)")
    groups = file_groups(files, task_count(files, ctx))
    ctx.log.info("ingest %s: %d files (%s bytes) under %s, read by %d tasks", ctx.name, len(files),
                 f"{sum(files.values()):,}", base, len(groups))
    return _read_files(ctx, base.rstrip("/"), groups, provenance | {"files": len(files)}, selection.left_out,
                       sum(files.values()))


def task_count(files: dict[str, int], ctx: StepContext[IngestConfig]) -> int:
    """One task per TASK_BYTES of input or FILES_PER_TASK files, at least the data phase's CPUs
    (how.resources.data), at most one per file; one when max_documents caps the source (the first documents in
    file order)."""
    if ctx.config.max_documents:
        return 1
    shape = ctx.runtime.how.shape("data")
    cpus = shape.nodes * (shape.cpus_per_node or ctx.runtime.how.orchestration.workers)
    by_data = max(math.ceil(sum(files.values()) / TASK_BYTES), math.ceil(len(files) / FILES_PER_TASK))
    return max(1, min(len(files), max(cpus, by_data)))


def file_groups(files: dict[str, int], tasks: int) -> list[list[str]]:
    """The files (sorted) cut into `tasks` contiguous groups of about equal bytes, none empty: the shards
    concatenated in order hold the documents in the source's file order."""
    names = sorted(files)
    tasks = max(1, min(tasks, len(names)))
    total = sum(files.values())
    groups: list[list[str]] = [[]]
    done = 0
    for i, name in enumerate(names):
        left, unopened = len(names) - i, tasks - len(groups)
        if groups[-1] and unopened and (left <= unopened or done >= total * len(groups) / tasks):
            groups.append([])
        groups[-1].append(name)
        done += files[name]
    return groups


def _read_files(ctx: StepContext[IngestConfig], base: str, groups: list[list[str]], provenance: dict,
                left_out: dict[str, str], input_bytes: int | None = None) -> StepResult:
    from compass.tasks.data.curate_blocks import ShardWriter
    from compass.tasks.data.places import DataPlaces
    from compass.tasks.data.source_reader import SourceReader

    cfg = ctx.config
    places = DataPlaces.of(ctx)
    work = places.local
    settings = ReadSettings(source=ctx.name, uri=cfg.uri, format=cfg.format, text_key=cfg.text_key, split=cfg.split,
                            section_chars=cfg.section_chars, domain=cfg.domain, language=cfg.language,
                            max_document_chars=cfg.max_document_chars)
    _fresh_unless_same(work, {"base": base, "groups": groups, "settings": settings.__dict__,
                              "limit": cfg.max_documents})
    reader = SourceReader(base, groups, settings, str(work / "skipped"), limit=cfg.max_documents or -1)
    writer = ShardWriter(places.output(DOCUMENTS, DOCUMENTS), written_records=places.records("ingest"))
    stage = run_stage(ctx.runtime, "ingest", places.stage_logs, [reader, writer], len(groups), ctx.log, input_bytes)
    stats = next(b.stats for b in stage.blocks if b.name.endswith(SourceReader.name))
    skipped = dict(left_out)
    for path in sorted((work / "skipped").glob("*.json")):
        skipped |= json.loads(path.read_text())
    dropped = {k.removeprefix("dropped_"): int(v) for k, v in stats.items() if k.startswith("dropped_") and v}
    n_files = provenance["files"]
    n_docs, n_chars = int(stats.get("documents", 0)), int(stats.get("characters", 0))
    if n_docs == 0:
        raise DataError(f"source {ctx.name}: {n_files} files matched but none held text"
                        + (f" ({len(skipped)} skipped as binary or not UTF-8)" if skipped else "")
                        + (f"; documents dropped: {dropped} (max_document_chars is {cfg.max_document_chars:,})"
                           if dropped else ""))
    places.publish(ctx, ["ingest"], DOCUMENTS, DOCUMENTS)
    block = f"{SourceReader.type}: {SourceReader.name}"
    ranks = rank_block_stats(places.stage_logs, "ingest", len(groups), block)
    per_shard = {f"{rank:05d}{SHARD_SUFFIX}": {"documents": int(r.get("documents", 0)),
                                          "characters": int(r.get("characters", 0))}
                 for rank, r in enumerate(ranks) if r.get("documents")}  # a rank with no documents writes no shard
    return _result(ctx, n_files, n_docs, n_chars, len(groups), per_shard, skipped, dropped, provenance)


def _fresh_unless_same(work: Path, plan: dict) -> None:
    """Completed ranks in `work` are kept for a relaunch of the same reading plan only: a work folder left by
    another plan (other files, other groups) is cleared, so no rank's old shard is taken as done."""

    record = work / "plan.json"
    wanted = json.dumps(plan, sort_keys=True)
    if record.exists() and record.read_text() == wanted:
        return
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    record.write_text(wanted)


def _write_generated(ctx: StepContext[IngestConfig], documents: Iterator[dict], provenance: dict) -> StepResult:
    """Generated documents (no files to read): written in this process by the same shard writer."""
    from datatrove.data import Document

    from compass.tasks.data.curate_blocks import ShardWriter

    dropped: dict[str, int] = {}
    counts = {"documents": 0, "characters": 0}

    def kept() -> Iterator[Document]:
        for doc in documents:
            reason = drop_reason(doc["text"], ctx.config.max_document_chars)
            if reason:
                dropped[reason] = dropped.get(reason, 0) + 1
                continue
            counts["documents"] += 1
            counts["characters"] += len(doc["text"])
            yield Document(text=doc["text"], id=doc["id"], metadata=doc.get("metadata", {}))
            if ctx.config.max_documents and counts["documents"] >= ctx.config.max_documents:
                return

    with ShardWriter(str(ctx.out / DOCUMENTS)) as writer:
        for document in kept():
            writer.write(document, rank=0)
    if counts["documents"] == 0:
        raise DataError(f"source {ctx.name}: no documents generated")
    return _result(ctx, 0, counts["documents"], counts["characters"], 1, {"00000" + SHARD_SUFFIX: counts}, {}, dropped,
                   provenance | {"files": 0})


def _result(ctx: StepContext[IngestConfig], n_files: int, n_docs: int, n_chars: int, tasks: int,
            per_shard: dict[str, dict[str, int]], skipped: dict[str, str], dropped: dict[str, int],
            provenance: dict) -> StepResult:
    """The step's report; stats.json keeps the documents and characters of each shard (`per_shard`)."""
    cfg = ctx.config
    if dropped:
        ctx.log.warning("ingest %s: dropped %s documents (%s characters at most, no NUL, at most %.0f%% U+FFFD)",
                        ctx.name, dropped, f"{cfg.max_document_chars:,}", 100 * MAX_REPLACEMENT_SHARE)
    if skipped:
        ctx.log.warning("ingest %s: skipped %d of %d files that are not text: %s", ctx.name, len(skipped),
                        n_files, "; ".join(f"{k} ({v})" for k, v in list(skipped.items())[:5]))
    shards = len(per_shard)
    stats = {"files": n_files, "documents": n_docs, "characters": n_chars, "tasks": tasks, "shards": shards,
             "per_shard": per_shard, "dropped_documents": dropped, "skipped_files": skipped}
    (ctx.out / "stats.json").write_text(json.dumps(stats, indent=2))
    metrics = {"files": n_files, "documents": n_docs, "characters": n_chars, "shards": shards, "tasks": tasks,
               "skipped_files": len(skipped), "skipped": dict(list(skipped.items())[:20]),
               "dropped": dropped, "skipped_too_long": dropped.get("too_long", 0)}
    summary = (f"### ingest `{ctx.name}`\n\n{cfg.uri} -> {n_docs:,} documents, {n_chars:,} characters "
               f"from {n_files:,} files in {shards} shards\n\nprovenance: `{json.dumps(provenance)}`")
    return StepResult(metrics=metrics, summary=summary, provenance=[provenance])


def _local_fs():
    import fsspec

    return fsspec.filesystem("file")


@dataclass(frozen=True)
class Selection:
    """The files a step reads (path under the source -> bytes) and those it leaves out with the reason: links that
    lead outside the source folder, files of the store itself."""

    files: dict[str, int]
    left_out: dict[str, str]


def _select(fs, base: str, include: list[str], exclude: list[str], store: Store | None = None) -> Selection:
    """The source's files matching include and not exclude, from one listing. In a local folder, a file that
    resolves outside the folder (a link to /etc/passwd) is left out, and so is the store's own folder when the
    source holds it (its manifests and shards are no training text)."""
    found: dict[str, int] = {}
    left_out: dict[str, str] = {}
    root = fs._strip_protocol(base)
    local = "file" in fs.protocol
    real_root = os.path.realpath(root) if local else ""
    store_root = (os.path.realpath(store.root_path) if local and store is not None and not store.is_remote
                  else None)
    for pattern in include:
        for path, info in fs.glob(f"{root}/{pattern}", detail=True).items():
            rel = path[len(root) + 1:]
            if local and info.get("islink"):  # the listing describes the link; what counts is where it leads
                info = {"type": "file" if os.path.isfile(path) else "other", "size": os.path.getsize(path)}
            if info.get("type") != "file" or any(fnmatch.fnmatch(rel, ex) for ex in exclude):
                continue
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:  # bytes that decode to no name (`bad\xff\xfe.txt`): no record can carry it
                shown = rel.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
                left_out[shown] = "a file name that is not UTF-8: rename it to include it"
                continue
            if local:
                real = os.path.realpath(path)
                if os.path.commonpath([real, real_root]) != real_root:
                    left_out[rel] = "a link to a file outside the source folder"
                    continue
                if store_root and os.path.commonpath([real, store_root]) == store_root:
                    left_out[rel] = "a file of the store"
                    continue
            found[rel] = int(info.get("size") or 0)
    return Selection(dict(sorted(found.items())), dict(sorted(left_out.items())))


# 2: binary and non-UTF-8 files are skipped (they were decoded with U+FFFD replacements)
# 3: records with NUL bytes or mostly U+FFFD are dropped; files and lines are read with a byte cap
# 4: a datatrove pipeline: one shard per task (groups of files by bytes), reproducible gzip
# 5: shards in zstd (level 3), not gzip -6
KIND = StepKind("ingest", IngestConfig, run_ingest, build, version="5", resources=phase("data"),
                check_machine=check_machine, fans_out=True,
                headline=("documents", "characters"))
STEP_KINDS = (KIND,)
