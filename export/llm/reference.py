"""An LLM package's reference set (core/reference.py): transformers' greedy continuations of the eval set or the
sample prompts, with the top log-probabilities at each step, from the model as trained (an adapter through PEFT)."""

from __future__ import annotations

from pathlib import Path

from core.reference import Item, ReferenceSet, fingerprint

from ..exceptions import ExportError
from ..reference import eval_items, versions


# LLMs: how long a continuation the reference holds, the top log-probabilities kept per position, and how much less
# likely (to the framework) a served token may be where the two part, for the parting to count as a near tie.
LLM_MAX_TOKENS, LLM_MAX_TOKENS_GOLD, LLM_TOP_LOGPROBS, LLM_TIE_LOGPROB = 32, 256, 5, 0.5


def llm_items(tokenizer, template: str | None, prompts: list[str], eval_set: Path | None) -> list[Item]:
    """The eval set's inputs, or the sample prompts: each as a chat turn where the model has a chat template (what a
    wrong template would change), and the first two as plain completions too (what the weights and tokenizer alone
    answer)."""
    from core.tasks import TEXT_GENERATION

    items = eval_items(eval_set, TEXT_GENERATION)
    if items is not None:
        return items
    chats = [Item(input={"messages": [{"role": "user", "content": p}]}) for p in prompts] if template else []
    return chats + [Item(input={"prompt": p}) for p in prompts[: 2 if template else len(prompts)]]


def llm_reference(model, tokenizer, template: str | None, items: list[Item], *, source: Path,
                  made_from: str, peft: bool = False) -> ReferenceSet:
    """The framework's greedy continuation of each item (a chat through `template`, the chat template the model was
    trained with; a prompt as vLLM's completions tokenize it), with the top log-probabilities at each position, from
    `model` (transformers, or base + adapter through PEFT) as it is loaded."""
    import torch

    eos = _eos_ids(model, tokenizer)
    longest = max((len(tokenizer(str(i.gold))["input_ids"]) for i in items if i.gold is not None), default=0)
    max_tokens = min(LLM_MAX_TOKENS_GOLD, longest + 8) if longest else LLM_MAX_TOKENS
    expected = []
    with torch.no_grad():
        for item in items:
            if "messages" in item.input:
                if not template:
                    raise ExportError("the eval set has chat messages, and the model has no chat template: give "
                                      "--chat-template, or prompts")
                text = tokenizer.apply_chat_template(item.input["messages"], chat_template=template,
                                                     add_generation_prompt=True, tokenize=False)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = tokenizer(item.input["prompt"])["input_ids"]
            expected.append(_greedy(model, tokenizer, ids, max_tokens, eos))
    return ReferenceSet(
        task="text-generation", framework=versions("transformers", *(("peft",) if peft else ())), source=str(source),
        made_from=made_from, tokenizer=_tokenizer_fingerprint(tokenizer),
        settings={"max_tokens": max_tokens, "top_logprobs": LLM_TOP_LOGPROBS, "tie_logprob": LLM_TIE_LOGPROB,
                  "eos_token_ids": sorted(eos), "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")},
        items=[i.model_copy(update={"expect": e}) for i, e in zip(items, expected)])


def _eos_ids(model, tokenizer) -> set[int]:
    """The tokens that end a generation, as vLLM reads them: the tokenizer's end of sequence and the generation
    config's."""
    found = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    found |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return found


def _tokenizer_fingerprint(tokenizer) -> str | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return fingerprint(backend.to_str()) if backend is not None else None


def _greedy(model, tokenizer, ids: list[int], max_tokens: int, eos: set[int]) -> dict:
    """Greedy decoding with no processor (no repetition penalty, whatever generation_config.json says), its raw
    logits' top log-probabilities at each step."""
    import torch
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, num_beams=1, eos_token_id=sorted(eos) or None,
                              pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0),
                              output_logits=True, return_dict_in_generate=True)
    out = model.generate(input_ids=torch.tensor([ids], device=device),
                         attention_mask=torch.ones((1, len(ids)), dtype=torch.long, device=device), generation_config=config)
    new = out.sequences[0, len(ids):].tolist()
    top = []
    for logits in out.logits[: len(new)]:
        values, indices = torch.log_softmax(logits[0].float(), -1).topk(LLM_TOP_LOGPROBS)
        top.append([[int(i), float(v)] for i, v in zip(indices, values)])
    return {"token_ids": new, "tokens": [tokenizer.decode([t]) for t in new],
            "text": tokenizer.decode(new, skip_special_tokens=True), "top_logprobs": top}
