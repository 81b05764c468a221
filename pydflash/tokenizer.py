"""Tokenizer and chat template of a GGUF, through llama.cpp's vocab-only load (no model weights).

The vocabulary metadata is checked first (`check_vocabulary`): llama.cpp's loader aborts the process on some
malformed vocabularies. The chat template is untrusted input from the file: it is rendered in Jinja's immutable
sandbox (a template cannot reach Python internals: llama-cpp-python's CVE-2024-34359 was exactly that), with
bounds on its run time and on what it may allocate or print, and only when a chat prompt needs it, so a broken
template never stops a plain load. Message contents are tokenized as plain text: only the template's own
markup becomes control tokens, so a user cannot forge a turn by typing "<|im_end|>".
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import sys
import threading
import time

from .validate import check_tokenizer

RENDER_SECONDS = 2.0              # a chat template renders in milliseconds; this only stops a hostile one
RENDER_MIN_CHARS = 1 << 20        # output bound: this plus 4x the messages' own text
MAX_INT_ARGUMENT = 1 << 20        # largest count a template may pass to a filter or repeat a sequence by


class ChatTemplateError(ValueError):
    """The GGUF's chat template failed, ran too long, or produced too much."""


def check_vocabulary(gf) -> None:
    """Check a GGUF's tokenizer metadata before llama.cpp reads it (the vocabulary must match token_embd)."""
    from .gguf_io import GGUFError
    emb = gf.tensors.get("token_embd.weight")
    if emb is None or len(emb.ne) != 2:
        raise GGUFError(f"{gf.path}: missing tensor 'token_embd.weight' (2-D), which sizes the vocabulary")
    check_tokenizer(gf, int(emb.ne[1]))

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
    def __init__(self, path, gguf=None, *, verbose: bool = False):
        """path: the GGUF; gguf: its already parsed GGUFFile, if at hand (the chat template is read from it).
        verbose: accepted for llama-cpp-python parity; llama.cpp's load log is collected, and only its
        errors are shown (in the exception) when the load fails."""
        import llama_cpp
        from llama_cpp._internals import LlamaModel

        self._llama_cpp = llama_cpp
        self.path = os.fspath(path)
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        with _LlamaLog() as log:
            try:
                self._model = LlamaModel(path_model=self.path, params=params, verbose=False)
            except ValueError:
                reason = log.errors() or "no reason given"
                raise ValueError(f"{self.path}: llama.cpp refused the vocabulary: {reason}") from None
        self._vocab = self._model.vocab
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.eos_id = int(llama_cpp.llama_vocab_eos(self._vocab))
        if gguf is None:
            from .gguf_io import GGUFFile
            gguf = GGUFFile(self.path)
        # from our own reader: llama-cpp-python's metadata() fails on a value that is not valid UTF-8
        template = gguf.get("tokenizer.chat_template")
        self.chat_template = template if isinstance(template, str) else None

    def tokenize(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Text to token ids. parse_special: special tokens written in the text (e.g. <|im_end|>) become their
        ids; only for trusted text (a raw prompt), never for a chat message (use `chat_ids`)."""
        if not isinstance(text, str):
            raise TypeError(f"expected text (str), got {type(text).__name__}")
        return list(self._model.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special))

    def detokenize(self, ids) -> str:
        return self._model.detokenize(list(ids)).decode("utf-8", errors="replace")

    def detokenize_bytes(self, ids, *, special: bool = False) -> bytes:
        """The raw bytes of `ids` (an incomplete UTF-8 sequence stays as it is)."""
        return self._model.detokenize([int(t) for t in ids], special=special)

    def piece(self, token: int) -> bytes:
        """The bytes llama.cpp's own programs print for one token (llama_token_to_piece, special tokens
        rendered, no space stripped): what a llama.cpp peer's output is made of (pydflash.llama_peers)."""
        buf = ctypes.create_string_buffer(256)
        n = self._llama_cpp.llama_token_to_piece(self._vocab, int(token), buf, len(buf), 0, True)
        if n < 0:
            raise ValueError(f"token {token}: its piece is longer than {len(buf)} bytes")
        return buf.raw[:n]

    @property
    def bos_id(self) -> int:
        return int(self._model.token_bos())

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
        return dict(self._model.metadata())

    def token_text(self, token: int) -> str:
        return self._model.detokenize([int(token)], special=True).decode("utf-8", errors="replace")

    def is_end_of_generation(self, token: int) -> bool:
        """EOS, end-of-turn (<|im_end|>) or any other token the vocabulary marks as ending generation."""
        return bool(self._llama_cpp.llama_vocab_is_eog(self._vocab, int(token)))

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            **template_vars) -> str:
        """The rendered chat as text (for display; tokenize a chat with `chat_ids`). template_vars (tools,
        enable_thinking, ...) become template variables. Like Hugging Face's renderer: loop controls, `tojson`
        (plain JSON, not HTML-escaped), `strftime_now`."""
        return self._render(_check_messages(messages), add_generation_prompt, template_vars)

    def chat_ids(self, messages: list[dict], *, add_generation_prompt: bool = True, **template_vars) -> list[int]:
        """Token ids of a chat: the template's markup with special-token parsing, every message content as
        plain text (a content holding "<|im_start|>" stays those characters)."""
        return self.chat_prompt(messages, add_generation_prompt=add_generation_prompt, **template_vars)[0]

    def chat_prompt(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    **template_vars) -> tuple[list[int], str]:
        """`chat_ids` and the rendered text they stand for (one render)."""
        messages = _check_messages(messages)
        nonce = secrets.token_hex(8)
        # an empty content has nothing to protect, and templates test it ("if content") to drop the block
        marks = [f"\u27e6{nonce}:{i}\u27e7" if m["content"] else None for i, m in enumerate(messages)]
        rendered = self._render([{**m, "content": mark} if mark else m for m, mark in zip(messages, marks)],
                                add_generation_prompt, template_vars)
        ids, text, rest = [], [], rendered
        for message, mark in zip(messages, marks):
            if mark is None:
                continue
            before, found, rest = rest.partition(mark)
            if not found or mark in rest:
                raise ChatTemplateError(f"{self.path}: the chat template does not place each message's content "
                                        f"once and unchanged, so user text cannot be kept apart from its markup")
            ids += self.tokenize(before, parse_special=True)
            ids += self.tokenize(message["content"], parse_special=False)
            text += (before, message["content"])
        return ids + self.tokenize(rest, parse_special=True), "".join(text) + rest

    def _render(self, messages: list[dict], add_generation_prompt: bool, template_vars: dict) -> str:
        if not self.chat_template:
            raise ValueError(f"{self.path}: the GGUF has no tokenizer.chat_template")
        bos = self._model.token_bos()
        # the output bound grows with everything the template is given (tool schemas, tool calls included)
        given = len(json.dumps([messages, template_vars], ensure_ascii=False, default=str))
        return render_template(self.chat_template, RENDER_MIN_CHARS + 4 * given, f"{self.path}: chat template",
                               **template_vars, messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.token_text(bos) if bos >= 0 else "",
                               eos_token=self.token_text(self.eos_id))


def _check_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError("messages: expected a non-empty list of {'role': str, 'content': str}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"messages[{i}]: expected {{'role': str, 'content': str}}, got {m!r:.80}")
    return [dict(m) for m in messages]


# --- the sandbox --------------------------------------------------------------------------------------------------

def render_template(source: str, max_chars: int, what: str, **variables) -> str:
    """Render an untrusted Jinja template in the immutable sandbox within RENDER_SECONDS and max_chars of
    output; sequence repetition and the counts given to filters are bounded too (`[1]*10**9` would allocate
    gigabytes in one step, before any time check)."""
    import jinja2
    try:
        template = _environment().from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"{what}: {type(e).__name__}: {e}") from None
    deadline = time.monotonic() + RENDER_SECONDS
    pieces, size = [], 0
    with _Deadline(deadline, what):
        try:
            for piece in template.generate(**variables):
                size += len(piece)
                if size > max_chars:
                    raise ChatTemplateError(f"{what}: output exceeds {max_chars} characters")
                pieces.append(piece)
        except ChatTemplateError as e:
            if str(e).startswith(what):
                raise
            raise ChatTemplateError(f"{what}: {e}") from None
        except (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, AttributeError,
                MemoryError, RecursionError) as e:
            raise ChatTemplateError(f"{what}: {type(e).__name__}: {e}") from None
    return "".join(pieces)


_ENV = None


def _environment():
    global _ENV
    if _ENV is None:
        import datetime

        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class BoundedSandbox(ImmutableSandboxedEnvironment):
            intercepted_binops = frozenset({"*", "**", "%"})

            def call_binop(self, context, operator, left, right):
                if operator == "*":
                    for seq, n in ((left, right), (right, left)):
                        if isinstance(seq, (str, list, tuple)) and isinstance(n, int) \
                                and len(seq) * n > MAX_INT_ARGUMENT:
                            raise ChatTemplateError(f"a sequence repeated to {len(seq) * n} items")
                if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                    raise ChatTemplateError(f"exponent {right} is too large")
                if operator == "%" and isinstance(left, str) and any(len(d) > 6 for d in _digit_runs(left)):
                    raise ChatTemplateError("a format width is too large")
                return super().call_binop(context, operator, left, right)

            def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
                _check_counts(args, kwargs)
                return super().call(__context, __obj, *args, **kwargs)

        def raise_exception(message):
            raise ChatTemplateError(f"raise_exception: {message}")

        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.filters = {name: _bounded(f) for name, f in env.filters.items()}
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(str(fmt))
        _ENV = env
    return _ENV


def _digit_runs(text: str):
    run = ""
    for ch in text:
        if ch.isdigit():
            run += ch
        elif run:
            yield run
            run = ""
    if run:
        yield run


def _check_counts(args, kwargs) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT_ARGUMENT:
            raise ChatTemplateError(f"a count of {v} passed to a filter or function")


def _bounded(f):
    def filter_(*args, **kwargs):
        _check_counts(args[1:], kwargs)
        return f(*args, **kwargs)
    # jinja passes the context/environment to filters marked for it: keep the marks
    filter_.__dict__.update(getattr(f, "__dict__", {}))
    for attr in ("jinja_pass_arg",):
        if hasattr(f, attr):
            setattr(filter_, attr, getattr(f, attr))
    return filter_


class _Deadline:
    """Stops the template's own Python code (Jinja compiles templates to Python) once the deadline passes, by
    tracing its lines in this thread only; the previous trace function (a debugger, coverage) is restored."""

    def __init__(self, deadline: float, what: str):
        self.deadline, self.what = deadline, what

    def _local(self, frame, event, arg):
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"{self.what}: rendering took longer than {RENDER_SECONDS} s")
        return self._local

    def _global(self, frame, event, arg):
        if frame.f_code.co_filename == "<template>":
            return self._local
        if time.monotonic() > self.deadline:   # also inside the filters and tests the template calls
            raise ChatTemplateError(f"{self.what}: rendering took longer than {RENDER_SECONDS} s")
        return None

    def __enter__(self):
        self._previous = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._previous)
        return False


class _LlamaLog:
    """Collects llama.cpp's log lines while loading, so a refusal carries llama.cpp's own reason (its stderr
    is silenced); llama-cpp-python's logger is put back afterwards."""

    _lock = threading.Lock()

    def __enter__(self):
        import llama_cpp
        from llama_cpp import _logger
        self._llama_cpp, self._default = llama_cpp, _logger.llama_log_callback
        self.lines: list[tuple[int, str]] = []

        @llama_cpp.llama_log_callback
        def collect(level, text, user_data):
            self.lines.append((int(level), text.decode("utf-8", errors="replace")))

        self._callback = collect
        self._lock.acquire()
        llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc):
        self._llama_cpp.llama_log_set(self._default, ctypes.c_void_p(0))
        self._lock.release()
        return False

    def errors(self) -> str:
        """The error lines (GGML_LOG_LEVEL_ERROR = 4, with their continuations), joined on one line."""
        out, keep = [], False
        for level, text in self.lines:
            keep = level == 4 or (level == 5 and keep)
            if keep:
                out.append(text.strip())
        return " ".join(t for t in out if t)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """`tojson` as the Hugging Face chat-template runtime defines it (what model templates are written for):
    plain json.dumps, not Jinja's HTML-safe Markup, which would escape the text a template adds to it (Qwen3.5's
    tool-call arguments are rendered as '<parameter=' + name + '>' + value|tojson)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
