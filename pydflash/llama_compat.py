"""`pydflash.Llama`: the high-level interface of llama-cpp-python's `llama_cpp.Llama`, on pydflash's engine.

    from pydflash import Llama            # was: from llama_cpp import Llama
    llm = Llama("Qwen3.5-27B-Q4_K_M.gguf", draft_model_path="Qwen3.5-27B-DFlash/", n_ctx=4096)
    out = llm("def fib(n):", max_tokens=64, stop=["\\n\\n"])
    print(out["choices"][0]["text"], out["usage"])
    for chunk in llm.create_chat_completion([{"role": "user", "content": "Hi"}], stream=True):
        print(chunk["choices"][0]["delta"].get("content", ""), end="")

Completions and chat completions return the same dicts and streaming chunks as llama-cpp-python (`id`,
`object`, `created`, `model`, `choices`, `usage`), with the same text, stop-sequence, `max_tokens` and token
counting rules, so greedy output is identical to `llama_cpp.Llama` on the same GGUF.

Sampling: arguments (`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `repeat_penalty`, `presence_penalty`,
`frequency_penalty`) go to the engine as given; while the engine decodes greedily only, anything but greedy
raises its ValueError. A call that gives none decodes greedily (llama-cpp-python would sample with
temperature 0.8): a default call works, and gives the same text as `llama_cpp.Llama(...)(prompt,
temperature=0)`. Values that change nothing (`top_p=1`, `repeat_penalty=1`, ...) are dropped.

Constructor arguments of llama-cpp-python that do not apply (threads, batch sizes, mmap, `n_gpu_layers`:
everything runs on the one device) are accepted; those that would change results (RoPE overrides, LoRA,
embeddings, other chat formats) are refused with a message naming them.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

LLAMA_DEFAULT_SEED = 0xFFFFFFFF          # llama.cpp's "pick a random seed"

# A call that names no sampling argument uses these: greedy (empty) while the engine only decodes greedily.
DEFAULT_SAMPLING: dict = {}

# Sampling arguments the engine takes, and the values at which each changes nothing (dropped, so that e.g.
# OpenAI-style `top_p=1.0` does not count as a sampling request).
ENGINE_SAMPLING_NEUTRAL = {"temperature": None, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0,
                           "presence_penalty": 0.0, "frequency_penalty": 0.0}

# llama-cpp-python per-call arguments pydflash does not implement: allowed only at their no-op value.
UNSUPPORTED_CALL_ARGS = {"suffix": None, "logprobs": None, "typical_p": 1.0, "tfs_z": 1.0, "mirostat_mode": 0,
                         "stopping_criteria": None, "logits_processor": None, "grammar": None, "logit_bias": None}

# Constructor arguments that do not change results here: accepted (and ignored).
HARMLESS_INIT_ARGS = frozenset({
    "split_mode", "main_gpu", "tensor_split", "use_mmap", "use_mlock", "n_batch", "n_ubatch", "n_threads",
    "n_threads_batch", "offload_kqv", "flash_attn", "op_offload", "no_perf", "last_n_tokens_size", "numa",
    "logits_all", "mirostat_tau", "mirostat_eta"})

# Constructor arguments that would change results: refused unless left at llama-cpp-python's default.
REFUSED_INIT_ARGS = {
    "vocab_only": False, "kv_overrides": None, "rope_scaling_type": -1, "pooling_type": -1, "attention_type": -1,
    "rope_freq_base": 0.0, "rope_freq_scale": 0.0, "yarn_ext_factor": -1.0, "yarn_attn_factor": 1.0,
    "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_orig_ctx": 0, "embedding": False, "lora_base": None,
    "lora_scale": 1.0, "lora_path": None, "chat_handler": None, "draft_model": None, "tokenizer": None,
    "spm_infill": False, "swa_full": None}

# llama.cpp's ggml type ids for type_k / type_v, as our KV cache types
GGML_KV_TYPES = {1: "f16", 8: "q8_0", 2: "q4_0"}

# In llama-cpp-python a token that leaves an incomplete UTF-8 character skips the max_tokens test; the engine
# is asked for this many tokens more so that such runs end where llama-cpp-python's do.
_UTF8_OVERRUN = 8


@dataclass
class _Completion:
    """One completion as llama-cpp-python counts it: tokens without the end-of-generation token."""
    tokens: list[int] = field(default_factory=list)
    text: bytes = b""
    finish_reason: str = "length"


class Llama:
    """llama-cpp-python's `Llama` on pydflash (see the module's docstring).

    model_path: target GGUF. draft_model_path: a DFlash draft (directory or config.json; None: plain AR
    decoding). n_ctx: context positions as in llama-cpp-python (0: the model's training context; the
    speculative verify's slots are added on top). n_gpu_layers: 0 runs on the CPU, anything else on `device`
    (partial offload does not exist here). kv_type ('f16', 'q8_0', 'q4_0', 'tq3_0') or llama.cpp's type_k /
    type_v ids. mode / budget: as in `pydflash.load`. verbose: show load progress (llama.cpp's own messages
    stay quiet either way). chat_format: only None (the GGUF's template)."""

    def __init__(self, model_path, *, draft_model_path=None, n_ctx: int = 512, n_gpu_layers: int = -1,
                 seed: int = LLAMA_DEFAULT_SEED, verbose: bool = False, chat_format: str | None = None,
                 device: str = "auto", kv_type: str | None = None, type_k: int | None = None,
                 type_v: int | None = None, mode: str | None = None, budget: int = 22, **llama_cpp_args):
        from .api import load
        from .gguf_io import GGUFFile

        _check_init_args(llama_cpp_args)
        if chat_format is not None:
            raise ValueError(f"Llama(chat_format={chat_format!r}): pydflash always uses the GGUF's own chat template "
                             "(tokenizer.chat_template); leave chat_format=None")
        kv_type = _kv_type(kv_type, type_k, type_v)
        self.model_path = str(model_path)
        self.draft_model_path = draft_model_path
        self.verbose = verbose
        self._seed = seed
        if n_ctx < 0:
            raise ValueError(f"Llama(n_ctx={n_ctx}): expected 0 (the model's training context) or a positive count")
        if n_ctx == 0:
            gguf = GGUFFile(self.model_path)
            n_ctx = int(gguf.get(f"{gguf.architecture}.context_length", 0) or 0)
            if n_ctx <= 0:
                raise ValueError(f"{self.model_path}: no context_length in the GGUF; pass n_ctx")
        self._n_ctx = n_ctx
        if n_gpu_layers == 0 and device not in ("auto", "cpu"):
            raise ValueError(f"Llama(n_gpu_layers=0, device={device!r}): n_gpu_layers=0 means the CPU")
        verify_slots = budget if draft_model_path is not None and mode != "ar" else 0
        self._engine = load(self.model_path, draft_model_path, device="cpu" if n_gpu_layers == 0 else device,
                            kv_type=kv_type, max_ctx=n_ctx + verify_slots, mode=mode, budget=budget,
                            progress=verbose)
        self._tokenizer = self._engine.tokenizer
        self.metadata = self._tokenizer.metadata

    # --- the vocabulary ---

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self._tok().tokenize(_as_text(text), add_special=add_bos, parse_special=special)

    def detokenize(self, tokens, prev_tokens=None, special: bool = False) -> bytes:
        return self._tok().detokenize_bytes(tokens, special=special)

    def n_ctx(self) -> int:
        return self._n_ctx

    def n_vocab(self) -> int:
        return self._tok().n_vocab

    def token_eos(self) -> int:
        return self._tok().eos_id

    def token_bos(self) -> int:
        return self._tok().bos_id

    # --- state ---

    def reset(self) -> None:
        """Forget the evaluated tokens: the next prompt is prefilled from scratch (without a reset, a prompt that
        extends an earlier one resumes from it, as in llama-cpp-python; the output is the same either way)."""
        self._live().reset()

    def close(self) -> None:
        """Release the model and its device memory; the object cannot generate afterwards."""
        self._engine = None
        self._tokenizer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- completions ---

    def __call__(self, prompt, *args, **kwargs):
        return self.create_completion(prompt, *args, **kwargs)

    def create_completion(self, prompt, suffix=None, max_tokens: int | None = 16, temperature=None, top_p=None,
                          min_p=None, typical_p: float = 1.0, logprobs=None, echo: bool = False, stop=None,
                          frequency_penalty=None, presence_penalty=None, repeat_penalty=None, top_k=None,
                          stream: bool = False, seed=None, tfs_z: float = 1.0, mirostat_mode: int = 0,
                          mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model=None, stopping_criteria=None,
                          logits_processor=None, grammar=None, logit_bias=None):
        """Complete `prompt` (text or token ids): a llama-cpp-python completion dict, or with stream=True an
        iterator of its chunks. Sampling arguments: see the module's docstring."""
        _check_unsupported(suffix=suffix, logprobs=logprobs, typical_p=typical_p, tfs_z=tfs_z,
                           mirostat_mode=mirostat_mode, stopping_criteria=stopping_criteria,
                           logits_processor=logits_processor, grammar=grammar, logit_bias=logit_bias)
        sampling = self._sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                                  repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                                  frequency_penalty=frequency_penalty)
        prompt_tokens = self._prompt_tokens(prompt)
        max_tokens = self._max_tokens(max_tokens, len(prompt_tokens))
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        head = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                "model": model if model is not None else self.model_path}
        if stream:
            return self._stream_chunks(head, prompt_tokens, max_tokens, stop, sampling)
        done = _Completion()
        for _ in self._decode(prompt_tokens, max_tokens, stop, sampling, done):
            pass
        text = done.text.decode("utf-8", errors="ignore")
        if echo:
            text = (prompt if isinstance(prompt, str) else self.detokenize(prompt_tokens).decode(
                "utf-8", errors="ignore")) + text
        return {**head,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": done.finish_reason}],
                "usage": {"prompt_tokens": len(prompt_tokens), "completion_tokens": len(done.tokens),
                          "total_tokens": len(prompt_tokens) + len(done.tokens)}}

    def create_chat_completion(self, messages, functions=None, function_call=None, tools=None, tool_choice=None,
                               temperature=None, top_p=None, top_k=None, min_p=None, typical_p: float = 1.0,
                               stream: bool = False, stop=None, seed=None, response_format=None,
                               max_tokens: int | None = None, presence_penalty=None, frequency_penalty=None,
                               repeat_penalty=None, tfs_z: float = 1.0, mirostat_mode: int = 0,
                               mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model=None,
                               logits_processor=None, grammar=None, logit_bias=None, logprobs=None,
                               top_logprobs=None):
        """A chat completion over `messages` rendered with the GGUF's chat template (tools and functions are
        handed to the template): llama-cpp-python's chat.completion dict, or its chunks with stream=True."""
        if response_format is not None and response_format.get("type") not in (None, "text"):
            raise ValueError(f"response_format={response_format!r}: grammar-constrained output is not supported "
                             "by pydflash")
        if isinstance(tool_choice, dict):
            raise ValueError(f"tool_choice={tool_choice!r}: forcing a function needs grammar-constrained decoding, "
                             "which pydflash does not have; use tool_choice='auto' or None")
        if logprobs:
            raise ValueError("logprobs=True: pydflash does not return log-probabilities")
        tok = self._tok()
        # message contents stay plain text: a user cannot forge a turn by typing "<|im_end|>"
        prompt_tokens = tok.chat_ids(messages, functions=functions, function_call=function_call,
                                     tools=tools, tool_choice=tool_choice)
        stop = ([stop] if isinstance(stop, str) else list(stop or [])) + [tok.token_text(tok.eos_id)]
        completion = self.create_completion(
            prompt_tokens, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            typical_p=typical_p, stop=stop, seed=seed, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, repeat_penalty=repeat_penalty, tfs_z=tfs_z,
            mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, model=model,
            logits_processor=logits_processor, grammar=grammar, logit_bias=logit_bias, stream=stream)
        return _chat_chunks(completion) if stream else _chat_completion(completion)

    # --- internals ---

    def _tok(self):
        if self._tokenizer is None:
            raise RuntimeError("this Llama was closed")
        return self._tokenizer

    def _live(self):
        if self._engine is None:
            raise RuntimeError("this Llama was closed")
        return self._engine

    def _prompt_tokens(self, prompt) -> list[int]:
        """llama-cpp-python's prompt: text is tokenised with special tokens parsed and BOS/EOS added where the
        vocabulary asks for them; token ids are taken as they are."""
        tok = self._tok()
        if isinstance(prompt, str):
            tokens = tok.tokenize(prompt, add_special=False, parse_special=True) if prompt else []
            if tok.add_bos and tok.bos_id >= 0:
                tokens = [tok.bos_id] + tokens
            if tok.add_eos and tok.eos_id >= 0:
                tokens = tokens + [tok.eos_id]
        else:
            tokens = [int(t) for t in prompt]
        if not tokens:
            raise ValueError("the prompt is empty (and the vocabulary adds no BOS token)")
        if len(tokens) >= self._n_ctx:
            raise ValueError(f"Requested tokens ({len(tokens)}) exceed context window of {self._n_ctx}")
        return tokens

    def _max_tokens(self, max_tokens, n_prompt: int) -> int:
        """llama-cpp-python's rule: None or <= 0 means up to the context's end; never past it."""
        room = self._n_ctx - n_prompt
        if max_tokens is None or max_tokens <= 0:
            return room
        return max_tokens if max_tokens + n_prompt < self._n_ctx else room

    def _sampling(self, **given) -> dict:
        """The sampling keywords for the engine: what the caller gave, less values that change nothing. As in
        llama.cpp, temperature 0 is greedy whatever top_p / top_k / min_p / seed say (the penalties still
        apply). None given: DEFAULT_SAMPLING."""
        seed = given.pop("seed")
        chosen = {name: value for name, value in given.items()
                  if value is not None and value != ENGINE_SAMPLING_NEUTRAL[name]}
        if chosen.get("temperature") == 0:
            for name in ("top_p", "top_k", "min_p"):
                chosen.pop(name, None)
            return chosen
        if not chosen:
            return dict(DEFAULT_SAMPLING)
        if seed is not None or self._seed != LLAMA_DEFAULT_SEED:
            chosen["seed"] = seed if seed is not None else self._seed
        return chosen

    def _decode(self, prompt_tokens, max_tokens: int, stop: list[str], sampling: dict, out: _Completion):
        """Run the engine and apply llama-cpp-python's per-token rules (end-of-generation token, incomplete
        UTF-8, stop strings, max_tokens); yields the text that is safe to stream, fills `out`."""
        tok = self._tok()
        stops = [s.encode("utf-8") for s in stop if s]
        asked = min(max_tokens + _UTF8_OVERRUN, self._n_ctx - len(prompt_tokens))
        batches = self._live().stream_tokens(prompt_tokens, max_tokens=asked, **sampling)
        text, sent, utf8_wait = b"", 0, 0
        try:
            for batch in batches:
                for token in batch:
                    if tok.is_end_of_generation(token):
                        out.finish_reason = "stop"
                        break
                    out.tokens.append(int(token))
                    text += tok.detokenize_bytes([token])   # llama.cpp detokenises token by token too
                    utf8_wait = _utf8_wait(text, utf8_wait)
                    if utf8_wait > 0:
                        utf8_wait -= 1
                        continue
                    hit = next((s for s in stops if s in text), None)
                    if hit is not None:
                        text, out.finish_reason = text[:text.index(hit)], "stop"
                        break
                    piece, sent = _streamable(text, sent, stops)
                    if piece:
                        yield piece
                    if len(out.tokens) >= max_tokens:
                        out.finish_reason = "length"
                        break
                else:
                    continue
                break
        finally:
            batches.close()
        out.text = text
        if len(text) > sent:
            rest = text[sent:].decode("utf-8", errors="ignore")
            if rest:
                yield rest

    def _stream_chunks(self, head: dict, prompt_tokens, max_tokens: int, stop, sampling):
        done = _Completion()
        for piece in self._decode(prompt_tokens, max_tokens, stop, sampling, done):
            yield {**head, "choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": None}]}
        yield {**head, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": done.finish_reason}]}


def _utf8_wait(text: bytes, wait: int) -> int:
    """llama-cpp-python's count of tokens to wait for when the last bytes start a multi-byte character (its
    exact rule, including how it reads texts shorter than 3 bytes)."""
    for k, byte in enumerate(text[-3:]):
        back = 3 - k
        for length, lead in ((2, 0xC0), (3, 0xE0), (4, 0xF0)):
            if length > back and byte & lead == lead:
                wait = length - back
    return wait


def _streamable(text: bytes, sent: int, stops: list[bytes]) -> tuple[str, int]:
    """The new text that can be streamed: up to the end, less a tail that may begin a stop string, less a
    multi-byte character still missing bytes. Returns (piece, new sent offset). Bytes that are not UTF-8 are
    dropped, as llama-cpp-python drops them from the whole text."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    end = _complete_end(text, len(text) - hold)
    if end <= sent:
        return "", sent
    return text[sent:end].decode("utf-8", errors="ignore"), end


def _complete_end(data: bytes, end: int) -> int:
    """`end`, moved back before a trailing multi-byte UTF-8 character whose continuation bytes are missing."""
    for back in range(1, min(4, end) + 1):
        byte = data[end - back]
        if byte & 0xC0 == 0x80:           # a continuation byte: its lead is further back
            continue
        length = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return end - back if length > back else end
    return end


def _chat_completion(completion: dict) -> dict:
    choice = completion["choices"][0]
    return {"id": "chat" + completion["id"], "object": "chat.completion", "created": completion["created"],
            "model": completion["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": choice["text"]}, "logprobs": None,
                         "finish_reason": choice["finish_reason"]}],
            "usage": completion["usage"]}


def _chat_chunks(chunks):
    for i, chunk in enumerate(chunks):
        head = {"id": "chat" + chunk["id"], "model": chunk["model"], "created": chunk["created"],
                "object": "chat.completion.chunk"}
        if i == 0:
            yield {**head, "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                                        "finish_reason": None}]}
        choice = chunk["choices"][0]
        delta = {"content": choice["text"]} if choice["finish_reason"] is None else {}
        yield {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                    "finish_reason": choice["finish_reason"]}]}


def _as_text(text) -> str:
    return text.decode("utf-8", errors="ignore") if isinstance(text, (bytes, bytearray)) else str(text)


def _kv_type(kv_type, type_k, type_v) -> str:
    if kv_type is not None:
        if type_k is not None or type_v is not None:
            raise ValueError("give kv_type or type_k/type_v, not both")
        return kv_type
    if type_k is None and type_v is None:
        return "f16"
    if type_k != type_v or type_k not in GGML_KV_TYPES:
        names = ", ".join(f"{i} ({name})" for i, name in GGML_KV_TYPES.items())
        raise ValueError(f"type_k={type_k}, type_v={type_v}: pydflash's KV cache takes one type for both, one of "
                         f"{names}; or kv_type='tq3_0'")
    return GGML_KV_TYPES[type_k]


def _check_init_args(args: dict) -> None:
    for name, value in args.items():
        if name in HARMLESS_INIT_ARGS:
            continue
        if name in REFUSED_INIT_ARGS:
            if value != REFUSED_INIT_ARGS[name]:
                hint = " (pass a DFlash draft as draft_model_path)" if name == "draft_model" else ""
                raise ValueError(f"Llama({name}={value!r}) is not supported by pydflash: it would change "
                                 f"results{hint}")
            continue
        raise TypeError(f"Llama() got an unexpected keyword argument {name!r}")


def _check_unsupported(**args) -> None:
    for name, value in args.items():
        if value != UNSUPPORTED_CALL_ARGS[name]:
            raise ValueError(f"{name}={value!r} is not supported by pydflash (leave it at "
                             f"{UNSUPPORTED_CALL_ARGS[name]!r})")
