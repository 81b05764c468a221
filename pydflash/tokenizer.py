"""Tokenizer and chat template of a GGUF, through llama-cpp-python's vocab-only load (no model weights).

The chat template is untrusted input from the file: it is rendered in Jinja's immutable sandbox, so a template
cannot reach Python internals (llama-cpp-python's CVE-2024-34359 was exactly that).
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os

_drop_log = None      # the ctypes callback that swallows llama.cpp's log lines (kept alive while installed)


@contextlib.contextmanager
def quiet_llama_cpp():
    """Keep llama.cpp's log lines off the terminal. llama-cpp-python 0.3.36 maps llama.cpp's log levels wrongly
    and prints warnings even with verbose=False (e.g. a vocabulary-only load's "n_ctx_seq > n_ctx_train")."""
    global _drop_log
    import llama_cpp
    from llama_cpp import _logger

    if _drop_log is None:
        _drop_log = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(_drop_log, ctypes.c_void_p(0))
    try:
        yield
    finally:   # give llama-cpp-python its own logger back
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


class Tokenizer:
    def __init__(self, path, *, verbose: bool = False):
        import llama_cpp
        self._llama_cpp = llama_cpp
        self.path = os.fspath(path)
        with contextlib.nullcontext() if verbose else quiet_llama_cpp():
            self._llm = llama_cpp.Llama(self.path, vocab_only=True, verbose=verbose)
        self._vocab = llama_cpp.llama_model_get_vocab(self._llm._model.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.eos_id = int(llama_cpp.llama_vocab_eos(self._vocab))
        self.chat_template = self._llm.metadata.get("tokenizer.chat_template")

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Text to token ids; special tokens written in the text (e.g. <|im_end|>) become their ids."""
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special))

    def detokenize(self, ids) -> str:
        return self._llm.detokenize(list(ids)).decode("utf-8", errors="replace")

    def detokenize_bytes(self, ids, *, special: bool = False) -> bytes:
        """The raw bytes of `ids` (an incomplete UTF-8 sequence stays as it is)."""
        return self._llm.detokenize([int(t) for t in ids], special=special)

    @property
    def bos_id(self) -> int:
        return int(self._llm.token_bos())

    @property
    def add_bos(self) -> bool:
        """Whether the vocabulary asks for BOS in front of a text prompt."""
        return bool(self._llama_cpp.llama_vocab_get_add_bos(self._vocab))

    @property
    def add_eos(self) -> bool:
        """Whether the vocabulary asks for EOS after a text prompt."""
        return bool(self._llama_cpp.llama_vocab_get_add_eos(self._vocab))

    @property
    def metadata(self) -> dict:
        """The GGUF's key/value metadata as strings (llama.cpp's view of it)."""
        return dict(self._llm.metadata)

    def token_text(self, token: int) -> str:
        return self._llm.detokenize([int(token)], special=True).decode("utf-8", errors="replace")

    def is_end_of_generation(self, token: int) -> bool:
        """EOS, end-of-turn (<|im_end|>) or any other token the vocabulary marks as ending generation."""
        return bool(self._llama_cpp.llama_vocab_is_eog(self._vocab, int(token)))

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            **template_vars) -> str:
        """Render `messages` through the GGUF's template; template_vars (tools, enable_thinking, ...) become
        template variables. Like Hugging Face's renderer: loop controls, `tojson`, `strftime_now`."""
        if not self.chat_template:
            raise ValueError(f"{self.path}: the GGUF has no tokenizer.chat_template")
        import datetime

        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        template = env.from_string(self.chat_template)
        bos = self._llm.token_bos()
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.token_text(bos) if bos >= 0 else "",
                               eos_token=self.token_text(self.eos_id), raise_exception=raise_exception,
                               strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt), **template_vars)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """`tojson` as the Hugging Face chat-template runtime defines it (what model templates are written for):
    plain json.dumps, not Jinja's HTML-safe Markup, which would escape the text a template adds to it (Qwen3.5's
    tool-call arguments are rendered as '<parameter=' + name + '>' + value|tojson)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
