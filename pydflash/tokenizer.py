"""Tokenizer and chat template of a GGUF, through llama-cpp-python's vocab-only load (no model weights).

The chat template is untrusted input from the file: it is rendered in Jinja's immutable sandbox, so a template
cannot reach Python internals (llama-cpp-python's CVE-2024-34359 was exactly that).
"""
from __future__ import annotations

import json
import os


class Tokenizer:
    def __init__(self, path):
        import llama_cpp
        self._llama_cpp = llama_cpp
        self.path = os.fspath(path)
        self._llm = llama_cpp.Llama(self.path, vocab_only=True, verbose=False)
        self._vocab = llama_cpp.llama_model_get_vocab(self._llm._model.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.eos_id = int(llama_cpp.llama_vocab_eos(self._vocab))
        self.chat_template = self._llm.metadata.get("tokenizer.chat_template")

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Text to token ids; special tokens written in the text (e.g. <|im_end|>) become their ids."""
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special))

    def detokenize(self, ids) -> str:
        return self._llm.detokenize(list(ids)).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        return self._llm.detokenize([int(token)], special=True).decode("utf-8", errors="replace")

    def is_end_of_generation(self, token: int) -> bool:
        """EOS, end-of-turn (<|im_end|>) or any other token the vocabulary marks as ending generation."""
        return bool(self._llama_cpp.llama_vocab_is_eog(self._vocab, int(token)))

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            **template_vars) -> str:
        """Render `messages` through the GGUF's template; template_vars (tools, enable_thinking, ...) become
        template variables."""
        if not self.chat_template:
            raise ValueError(f"{self.path}: the GGUF has no tokenizer.chat_template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.token_text(self._llm.token_bos()) if self._llm.token_bos() >= 0 else "",
                               eos_token=self.token_text(self.eos_id), raise_exception=raise_exception,
                               **template_vars)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """`tojson` as the Hugging Face chat-template runtime defines it (what model templates are written for):
    plain json.dumps, not Jinja's HTML-safe Markup, which would escape the text a template adds to it (Qwen3.5's
    tool-call arguments are rendered as '<parameter=' + name + '>' + value|tojson)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
