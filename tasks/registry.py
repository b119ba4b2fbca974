"""Which function executes which step kind. Imports are lazy: a phase's libraries load only when it runs."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module

from compass.tasks.base import StepContext, StepResult

_EXECUTORS: dict[str, str] = {
    "ingest": "compass.tasks.ingest:run_ingest",
    "curate": "compass.tasks.curate:run_curate",
    "tokenizer": "compass.tasks.tokenizer:run_tokenizer_selection",
    "tokenize": "compass.tasks.tokenize:run_tokenize",
    "pretrain": "compass.tasks.pretrain:run_pretrain",
    "long_context": "compass.tasks.long_context:run_long_context",
    "post_train": "compass.tasks.post_train:run_post_train",
    "evaluate": "compass.tasks.evaluate:run_evaluate",
    "report": "compass.tasks.report:run_success_report",
    "curves": "compass.tasks.curves:run_curves",
    "ablate": "compass.tasks.ablate:run_ablation",
    "compare": "compass.tasks.ablate:run_comparison",
}


def executable_kinds() -> set[str]:
    return set(_EXECUTORS)


def executor_for(kind: str) -> Callable[[StepContext], StepResult]:
    try:
        module, func = _EXECUTORS[kind].split(":")
    except KeyError:
        raise NotImplementedError(f"no executor for step kind '{kind}' in this version of compass") from None
    return getattr(import_module(module), func)
