"""Make lighteval 0.13 importable offline, without editing site-packages.

lighteval's task registry imports every built-in task module. Three of them break offline as installed:
`tiny_benchmarks` downloads a pickle at import time, and `mt_bench` / `mix_eval` call an API removed from
huggingface_hub 2.x. None of them can run without the network anyway, so before the registry loads we put
empty stand-ins (no tasks) under their module names. Loading the registry also imports the ifeval task, which
calls `nltk.download` at import time: offline that only tries the network and prints errors, so nltk's
downloader answers "not available" without a connection (a task that needs the resource still fails with
nltk's own LookupError). lighteval's sample cache lives at `cache_dir / model_name`, and with a model given
by absolute path that join *is* the model's folder: lighteval wrote its predictions into the checkpoint being
evaluated, a committed artifact (compass's input verification caught it). The cache is given a relative name
under its cache_dir instead. Every other lighteval task, metric and model loader is untouched. Tested by
tests/test_evaluate.py, which runs lighteval's own Pipeline offline.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

BROKEN_OFFLINE = (
    "lighteval.tasks.tasks.tiny_benchmarks",
    "lighteval.tasks.tasks.mt_bench.main",
    "lighteval.tasks.tasks.mix_eval.main",
)


def install() -> None:
    for name in BROKEN_OFFLINE:
        if name not in sys.modules:
            stand_in = types.ModuleType(name)
            stand_in.TASKS_TABLE = []  # type: ignore[attr-defined]
            stand_in.__doc__ = "compass: offline stand-in (see infra/lighteval_compat.py)"
            sys.modules[name] = stand_in
    import nltk

    nltk.download = _offline_download
    with grad_mode_kept():  # imported here, once, so that its module-level set_grad_enabled(False) is undone
        import lighteval.models.transformers.transformers_model  # noqa: F401

        _cache_beside_not_inside_the_model()


@contextmanager
def grad_mode_kept() -> Iterator[None]:
    """lighteval turns autograd off process-wide and never back on (`torch.set_grad_enabled(False)` when its
    transformers model module is imported and again when it loads a model); the calling thread gets its own mode
    back, or a training that later runs in the same thread (a Prefect worker thread, a test) computes no gradient."""
    import torch

    before = torch.is_grad_enabled()
    try:
        yield
    finally:
        torch.set_grad_enabled(before)


def _cache_beside_not_inside_the_model() -> None:
    from lighteval.utils.cache_management import SampleCache

    if getattr(SampleCache.__init__, "_compass", False):
        return
    original = SampleCache.__init__

    def init(self, model_config) -> None:  # noqa: ANN001 - lighteval's ModelConfig
        name = model_config.model_name
        if os.path.isabs(name):
            model_config = model_config.model_copy(update={"model_name": name.lstrip("/")})
        original(self, model_config)

    init._compass = True  # type: ignore[attr-defined]
    SampleCache.__init__ = init


def _offline_download(*_: object, **__: object) -> bool:
    """nltk's downloader, offline: nothing is fetched (nltk.download returns False when it fails)."""
    return False
