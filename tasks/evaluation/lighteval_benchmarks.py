"""Standard lighteval tasks (`source: lighteval`), run with lighteval's own prompt and metrics on a dataset
this machine already holds: the task's `hf_repo` as a local folder, or its snapshot in the Hugging Face hub
cache (what `hf download --repo-type dataset REPO` leaves there). Nothing is downloaded: a task whose data is
missing is refused when the spec is checked, before any work starts."""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from compass.infra.environment import hub_cache
from compass.infra.lighteval_compat import install
from compass.specs.base import HintedError

LOCAL_PREFIX = "compass_local_"  # lighteval refuses custom tasks that reuse a built-in task's name


class TaskDataMissing(HintedError):
    """A standard task that cannot run here; `hint` says how to make it runnable."""


@dataclass(frozen=True)
class LocalTask:
    """A lighteval task resolved to data on this machine."""

    name: str
    dataset: Path
    subset: str
    version: int

    @property
    def provenance(self) -> dict[str, Any]:
        return {"lighteval_task": self.name, "task_version": self.version, "dataset": str(self.dataset),
                "subset": self.subset}


@cache
def registry() -> dict[str, Any]:
    """lighteval's built-in task configs by name (imports every task module once: several seconds)."""

    install()
    from lighteval.tasks.registry import Registry

    return Registry.load_all_task_configs()


def _local_dataset(repo: str, revision: str | None) -> Path | None:
    if Path(repo).is_dir():
        return Path(repo)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, repo_type="dataset", revision=revision, cache_dir=hub_cache(),
                                      local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None


def _splits(dataset: Path, subset: str) -> set[str]:
    from datasets import load_dataset_builder

    builder = load_dataset_builder(str(dataset), name=subset if subset != "default" else None)
    return set((builder.config.data_files or {}).keys())


def _fewshot_split(config: Any) -> str | None:
    """The split lighteval draws few-shot examples from: the config's, else the first declared split outside the
    evaluation ones, train before dev before valid (None: it samples the evaluation split itself)."""
    if config.few_shots_split:
        return config.few_shots_split
    others = [k for k in config.hf_avail_splits if k not in config.evaluation_splits]
    return next((k for prefix in ("train", "dev", "valid", "default") for k in others if prefix in k), None)


def locate(name: str, fewshot: int = 0) -> LocalTask:
    """The task `name` with its data found on this machine; raises TaskDataMissing saying what is missing."""

    configs = registry()
    config = configs.get(name)
    if config is None:
        close = difflib.get_close_matches(name, list(configs), n=3)
        raise TaskDataMissing(f"'{name}' is not a lighteval task",
                              f"did you mean {', '.join(close)}?" if close else "see `lighteval tasks list`")
    dataset = _local_dataset(config.hf_repo, config.hf_revision)
    fetch = (f"download it where there is network (hf download --repo-type dataset {config.hf_repo}) and copy "
             f"the hub cache to {hub_cache()}, or use a benchmark compass has offline (source: compass)")
    if dataset is None:
        raise TaskDataMissing(f"lighteval task '{name}' reads the dataset '{config.hf_repo}' (subset "
                              f"'{config.hf_subset}'), which is not on this machine and cannot be downloaded "
                              "offline", fetch)
    needed = set(config.evaluation_splits)
    if fewshot and (split := _fewshot_split(config)):
        needed.add(split)
    try:
        missing = needed - _splits(dataset, config.hf_subset)
    except (ValueError, FileNotFoundError) as e:
        raise TaskDataMissing(f"lighteval task '{name}': the local copy of '{config.hf_repo}' at {dataset} has no "
                              f"subset '{config.hf_subset}' ({e})", fetch) from e
    if missing:
        raise TaskDataMissing(f"lighteval task '{name}' needs the split(s) {', '.join(sorted(missing))} of "
                              f"'{config.hf_repo}', which the local copy at {dataset} lacks", fetch)
    return LocalTask(name, dataset, config.hf_subset, int(config.version))


def local_configs(tasks: dict[str, str]) -> list[Any]:
    """Copies of the built-in configs reading the local data, named LOCAL_PREFIX + task name.

    `tasks` maps a lighteval task name to its local dataset folder."""
    out = []
    for name, dataset in tasks.items():
        config = copy.deepcopy(registry()[name])
        config.name = LOCAL_PREFIX + name
        config.hf_repo = dataset
        config.hf_revision = None
        out.append(config)
    return out
