"""Autoregressive greedy generation on a target model: the baseline the speculative decoders must equal."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class GenerationResult:
    tokens: list[int]                    # generated ids (the end-of-generation token included if it was hit)
    text: str
    stopped_on_eog: bool
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    stats: dict = field(default_factory=dict)

    @property
    def decode_tok_s(self) -> float:
        n = max(len(self.tokens) - 1, 0)   # the first token comes from the prefill
        return n / self.decode_s if self.decode_s > 0 else 0.0


def generate_greedy(target, prompt_ids, max_new_tokens: int, tokenizer=None, *, reset: bool = True
                    ) -> GenerationResult:
    """Prefill `prompt_ids`, then take the argmax token by token until `max_new_tokens` or an end-of-generation
    token of `tokenizer` (if given). Only the chosen token id crosses to the host per step."""
    prompt_ids = [int(t) for t in prompt_ids]
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    if reset:
        target.reset()
    if target.n_past + len(prompt_ids) + max_new_tokens - 1 > target.n_ctx:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + {max_new_tokens} new tokens do not fit in n_ctx "
                         f"{target.n_ctx}")
    t0 = time.perf_counter()
    target.prefill(prompt_ids, return_logits=False)
    token = target.argmax()
    t1 = time.perf_counter()
    out, eog = [token], False
    while True:
        if tokenizer is not None and tokenizer.is_end_of_generation(token):
            eog = True
            break
        if len(out) >= max_new_tokens:
            break
        token = target.step(token)
        out.append(token)
    t2 = time.perf_counter()
    text = tokenizer.detokenize(out) if tokenizer is not None else ""
    return GenerationResult(out, text, eog, len(prompt_ids), t1 - t0, t2 - t1)
