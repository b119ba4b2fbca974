"""Which function executes which step kind. Imports are lazy: a phase's libraries load only when it runs."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module

from tasks.base import StepContext, StepResult

_EXECUTORS: dict[str, str] = {
    "ingest": "tasks.ingest:run_ingest",
    "curate": "tasks.curate:run_curate",
    "tokenizer": "tasks.tokenizer:run_tokenizer_selection",
    "tokenize": "tasks.tokenize:run_tokenize",
    "pretrain": "tasks.pretrain:run_pretrain",
    "long_context": "tasks.long_context:run_long_context",
    "post_train": "tasks.post_train:run_post_train",
    "evaluate": "tasks.evaluate:run_evaluate",
    "report": "tasks.report:run_success_report",
    "curves": "tasks.curves:run_curves",
    "ablate": "tasks.ablate:run_ablation",
    "compare": "tasks.ablate:run_comparison",
}


def executable_kinds() -> set[str]:
    return set(_EXECUTORS)


def executor_for(kind: str) -> Callable[[StepContext], StepResult]:
    try:
        module, func = _EXECUTORS[kind].split(":")
    except KeyError:
        raise NotImplementedError(f"no executor for step kind '{kind}' in this version of compass") from None
    return getattr(import_module(module), func)
