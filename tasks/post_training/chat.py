"""Chat models: the ChatML template (with `{% generation %}` marks, so TRL can train on assistant tokens only)
set on our tokenizer and saved with it, and batched greedy generation for pairs, rollouts and vibe checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compass.tasks.common.devices import Device

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def load_chat_model(folder: Path, where: Device | None = None, own_template: bool = False) -> tuple[Any, Any]:
    """Model and tokenizer from an exported HF folder, made chat-ready: the ChatML tokens are added (and the
    embeddings grown) the first time, `<|im_end|>` ends a turn, and the template is set on the tokenizer. With a GPU
    `where`, the model is moved there (in bf16 when the spec trains in bf16) to generate. `own_template`: a model
    from outside the run (what.models) that has a chat template answers with it, its vocabulary untouched."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    if own_template and tokenizer.chat_template:
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return on_device(model, where), tokenizer
    if IM_END not in tokenizer.get_vocab():
        tokenizer.add_tokens([IM_START, IM_END], special_tokens=True)
    if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        import torch

        with torch.random.fork_rng(devices=[]):  # the new rows are the same every time this base is loaded
            torch.manual_seed(0)
            model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    if "/no_think" not in (tokenizer.chat_template or ""):  # a hybrid reasoner keeps its template (reasoning.py)
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.eos_token = IM_END
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return on_device(model, where), tokenizer


def on_device(model: Any, where: Device | None) -> Any:
    """The model on the step's GPU for generation (bf16 when the spec trains in bf16); unchanged on CPU."""
    if where is None or where.device == "cpu":
        return model
    import torch

    return model.to(device=where.device, dtype=torch.bfloat16 if where.bf16 else None)


def generate(model: Any, tokenizer: Any, conversations: list[list[dict[str, str]]], max_new_tokens: int,
             batch_size: int = 16, seed: int | None = None) -> list[str]:
    """Answers to each conversation: greedy, or sampled from `seed` (reproducible on CPU for the same
    conversations in the same order)."""
    import torch

    with torch.no_grad():
        return _generate(model, tokenizer, conversations, max_new_tokens, batch_size, seed)


def _generate(model: Any, tokenizer: Any, conversations: list[list[dict[str, str]]], max_new_tokens: int,
              batch_size: int, seed: int | None) -> list[str]:
    import torch

    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    answers: list[str] = []
    for start in range(0, len(conversations), batch_size):
        chunk = conversations[start:start + batch_size]
        prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chunk]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        if seed is not None:
            torch.manual_seed(seed + start)
        ends = model.generation_config.eos_token_id  # a model's own may list several (Qwen3: <|im_end|>, EOS)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=seed is not None, use_cache=True,
                             pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=ends if ends is not None else tokenizer.eos_token_id)
        answers += [tokenizer.decode(row[enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
                    for row in out]
    model.train(was_training)
    tokenizer.padding_side = "right"
    return answers
