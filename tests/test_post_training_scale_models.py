"""Models from outside the run (`what.models`): SmolLM3's APO pairs came from Qwen3-32B against Qwen3-0.6B. A model
named there is a step of its own (copied into the store with its lineage, never evaluated, never a `previous`);
a strong_vs_weak pair or a distillation teacher names it as `model:<name>`; it answers with its own chat template;
a name nothing uses, an unknown name and a teacher of another vocabulary are refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.conftest import run_up_to
from tests.hub_cache import tiny_llama

OWN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")


def spec_text(models: str, post: str) -> str:
    return f"""name: pairs-from-outside
why:
  reason: research
  question: Do pairs answered by a model from outside the run train the policy?
  hypothesis: They do, as the strong model's answers are preferred.
  success_criteria:
    - {{metric: "arc_easy:cf/acc", op: ">=", threshold: 0.0, checkpoint: final}}
what:
  model: {{init_from: ./base}}
{models}
  post_training:
{post}
"""


APO = """    - method: dpo
      name: apo
      loss_type: apo_zero
      dataset: "pypi://evals==3.0.1.post1"
      lr: 1.0e-4
      max_samples: 8
      max_length: 192
      batch_size: 4
      pairs: {kind: strong_vs_weak, strong: "model:helper", weak: "base_model:init"}"""
HELPER = "  models:\n    helper: {init_from: ./helper}"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A base to post-train and a helper with a chat template of its own (not ChatML) beside the spec."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("named-models")
    tiny_llama(root / "base")
    helper = tiny_llama(root / "helper")
    tokenizer = AutoTokenizer.from_pretrained(str(helper))
    tokenizer.chat_template = OWN_TEMPLATE
    tokenizer.save_pretrained(str(helper))
    from safetensors.torch import load_file, save_file

    weights = load_file(str(helper / "model.safetensors"))  # other weights than the base: other answers
    save_file({k: v.flip(0).contiguous() if v.dim() == 2 else v for k, v in weights.items()},
              str(helper / "model.safetensors"), metadata={"format": "pt"})
    return root


def write(folder: Path, text: str) -> Path:
    (folder / "spec.yaml").write_text(text)
    return folder / "spec.yaml"


def test_pairs_answered_by_a_named_model_with_its_own_template(folders: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compass.tasks.post_training.chat import generate

    spec = write(folders, spec_text(HELPER, APO))
    plan, outcomes = run_up_to(spec, "post_train:apo", tmp_path / "store")
    assert plan.step("post_train:apo").inputs["strong"] == "model:helper"
    assert plan.step("post_train:apo").inputs["previous"] == "base_model:init"  # the helper is not the run's model
    from compass.flows.compiler import compile_spec
    from compass.specs import load_spec

    full = compile_spec(load_spec(spec).spec)
    assert not [s for s in full.steps if s.kind == "evaluate" and "helper" in s.name]  # never evaluated

    helper = outcomes["model:helper"]
    digest = hashlib.sha256((folders / "helper" / "model.safetensors").read_bytes()).hexdigest()
    (origin,) = [p for p in helper.manifest.provenance if p.get("weights_sha256")]
    assert origin["source"] == str(folders / "helper") and origin["weights_sha256"] == digest

    apo = Path(outcomes["post_train:apo"].uri)
    pairs = [json.loads(line) for line in (apo / "pairs.jsonl").read_text().splitlines()]
    assert pairs
    model = AutoModelForCausalLM.from_pretrained(str(folders / "helper"))
    tokenizer = AutoTokenizer.from_pretrained(str(folders / "helper"))
    assert tokenizer.chat_template == OWN_TEMPLATE
    from compass.tasks.kinds.post_train import PAIR_SEED, PAIR_TOKENS

    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    prompts = [p["prompt"] for p in pairs]
    # what the helper says to the same prompts in its own template, sampled as the pairs are: the chosen answers;
    # in batches as the step generated them (its batch held every prompt, the dropped pairs' too)
    expected = dict(zip(map(json.dumps, _all_prompts(outcomes)),
                        generate(model, tokenizer, _all_prompts(outcomes), PAIR_TOKENS, seed=PAIR_SEED), strict=True))
    assert [p["chosen"][0]["content"] for p in pairs] == [expected[json.dumps(p)] for p in prompts]
    assert outcomes["post_train:apo"].manifest.metrics["pairs"] == len(pairs)


def _all_prompts(outcomes) -> list:
    """The prompts the step asked both models (before pairs with equal or empty answers were dropped)."""
    from compass.tasks.kinds.post_train import MAX_CHARS_PER_TOKEN, PAIR_TOKENS, fitting_prompts
    from compass.tasks.post_training.chat import load_chat_model
    from compass.tasks.post_training.datasets import chat_examples, dataset_root

    root, _ = dataset_root("pypi://evals==3.0.1.post1", Path("."))
    _, tokenizer = load_chat_model(Path(outcomes["base_model:init"].uri) / "final")
    conversations = chat_examples(root, 8, 1, 192 * MAX_CHARS_PER_TOKEN)
    return fitting_prompts([c[:-1] for c in conversations], tokenizer, 192 - PAIR_TOKENS)


def test_named_models_are_used_or_refused(folders: Path):
    from compass.specs import SpecError, load_spec
    from compass.specs.costs import library_step_memory

    with pytest.raises(SpecError) as unused:
        load_spec(write(folders, spec_text(HELPER + "\n    spare: {init_from: ./helper}", APO)))
    assert "what.models.spare" in str(unused.value) and "no step uses model 'spare'" in str(unused.value)
    from compass.flows.compiler import PlanError, compile_spec

    with pytest.raises(PlanError) as unknown:
        compile_spec(load_spec(write(folders, spec_text(HELPER, APO.replace("base_model:init", "model:qwen3-32b"))))
                     .spec)
    (issue,) = unknown.value.issues
    assert issue.loc == ("what", "post_training", 0, "pairs", "weak")
    assert "no model 'qwen3-32b' in what.models (named there: helper)" in issue.message
    with pytest.raises(SpecError) as missing:
        load_spec(write(folders, spec_text("  models:\n    helper: {init_from: ./nowhere}", APO)))
    assert "what.models.helper.init_from" in str(missing.value)

    loaded = load_spec(write(folders, spec_text(HELPER, APO)))
    resolved = loaded.spec.what.models["helper"].resolved
    assert resolved.model_type == "llama" and resolved.parameters == loaded.spec.what.model.resolved.parameters
    rows = {m.step: m for m in library_step_memory(loaded.spec)}
    answers = rows["post_train:apo answers by model:helper"]  # the plan sizes the helper on its GPU
    assert answers.weights == resolved.parameters * 4  # fp32 on CPU


def test_a_teacher_from_outside_must_share_the_students_vocabulary(folders: Path, tmp_path: Path):
    from transformers import AutoTokenizer

    from compass.tasks.kinds.post_train import same_vocabulary
    from compass.tasks.post_training.chat import IM_END, IM_START
    from tests.hub_cache import llama_like_tokenizer

    student = AutoTokenizer.from_pretrained(str(folders / "base"))
    student.add_tokens([IM_START, IM_END], special_tokens=True)
    same_vocabulary(folders / "helper", student, "distill d")  # the same tokenizer: accepted
    with pytest.raises(ValueError, match="another vocabulary than the student"):
        same_vocabulary(llama_like_tokenizer(tmp_path / "other"), student, "distill d")
