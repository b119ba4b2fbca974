"""`what.evaluation`: the lighteval suite every kept checkpoint is scored on."""

from typing import Literal

from pydantic import Field, PositiveInt

from compass.specs.base import SpecModel

CHOICES = ("cf", "mcf")  # cloze and lettered multiple choice
# The benchmarks compass scores on offline data, each with the formulations it offers: the vocabulary of a compass
# benchmark's `name`. tasks/evaluation/offline_benchmarks.py holds their data and prompts (tests/test_researcher_day.py
# holds the two to the same names).
COMPASS_BENCHMARKS: dict[str, tuple[str, ...]] = {
    **{name: CHOICES for name in ("arc_easy", "arc_challenge", "hellaswag", "piqa", "mmlu", "openbookqa",
                                  "commonsense_qa", "sciq", "social_iqa", "winogrande", "boolq", "copa")},
    "nq_open": ("gen",), "trivia_qa": ("gen",), "arithmetic": ("gen",),
}


class Benchmark(SpecModel):
    """One benchmark in one formulation: cloze (cf) gives early signal, multiple choice (mcf) later, generative
    (gen) for open answers."""

    name: str = Field(min_length=1, description="A compass offline benchmark (arc_easy, hellaswag, mmlu, ...) or, "
                                                "with source: lighteval, a lighteval task (winogrande, arc:easy).")
    source: Literal["compass", "lighteval"] = Field(
        default="compass", description="compass: offline data, cf/mcf prompts; lighteval: lighteval's own task, "
                                       "prompt and metrics, on data this machine holds.")
    formulation: Literal["cf", "mcf", "gen"] = Field(
        default="cf", description="cf: each answer scored as a continuation; mcf: lettered options; gen: the model "
                                  "writes its answer (nq_open, trivia_qa: exact match and F1; arithmetic: the GRPO "
                                  "verifier's accuracy on problems GRPO does not train on).")
    fewshot: int = Field(default=0, ge=0, description="Solved examples put before each question (0 = zero-shot).")
    limit: PositiveInt | None = Field(default=None, description="Evaluate the first N samples only.")

    @property
    def key(self) -> str:
        """The prefix of this task's metrics: `arc_easy:cf/acc`, `lighteval:winogrande/acc`."""
        return f"lighteval:{self.name}" if self.source == "lighteval" else f"{self.name}:{self.formulation}"


class Decontamination(SpecModel):
    """The fence between what trains and what is measured: every benchmark item the spec evaluates is indexed as word
    n-grams, and every training source (the curated sources pretraining, long context, ablations and mid-training
    mix, and what each post-training step draws) is scanned against it before anything trains."""

    policy: Literal["refuse", "remove", "report"] = Field(
        default="refuse", description="refuse: a match stops the run before training, with the report; remove: "
                                      "matching documents and examples are left out of training, the removal "
                                      "recorded in lineage; report: the report only.")
    n_grams: int = Field(default=13, ge=8, le=50, description="Words per n-gram (13, as GPT-3 and OLMo's decon).")
    scan: Literal["drawn", "whole"] = Field(
        default="drawn", description="Post-training datasets: drawn scans the examples each step draws (its "
                                     "max_samples, seed and length cap); whole scans every example of the dataset, "
                                     "so a leak is reported even where this run's draw misses it.")


class Evaluation(SpecModel):
    """What every model step is evaluated on (benchmarks, validation perplexities, passkey retrieval after long
    context), and the prompts each TRL post-training step answers for a person to read."""

    benchmarks: list[Benchmark] = Field(
        default_factory=list, description="Benchmarks each model step is scored on; the gate and ablation metrics "
                                          "draw on them too.")
    perplexity_sources: list[str] = Field(
        default_factory=list, description="Curated sources whose held-out split gives a validation perplexity."
    )
    vibe_prompts: list[str] = Field(default_factory=list, description="Fixed prompts a person reads.")
