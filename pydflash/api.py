"""The public Python API: `pydflash.load(...)` returns an `Engine` with `generate` and `stream`.

    import pydflash
    engine = pydflash.load("Qwen3.5-27B-Q4_K_M.gguf", "Qwen3.5-27B-DFlash/")
    result = engine.generate("Write a haiku about GPUs.", max_tokens=128, chat=True)
    print(result.text, result.stats["acceptance_length"], result.stats["decode_tok_s"])
    for piece in engine.stream("def fib(n):", max_tokens=64):
        print(piece, end="", flush=True)

Decoding is greedy by default; speculative modes return exactly the tokens plain decoding would. Sampling
options (temperature, top_k, top_p, min_p, seed, repeat_penalty, presence_penalty, frequency_penalty) make it
sample, with text distributed exactly as plain sampling with those settings in every mode (docs/sampling.md):
    engine.generate("Once upon a time", max_tokens=64, temperature=0.7, top_p=0.9, seed=1)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .engine import MODES, Decoder
from .plan import DRAFT_WINDOW, PREFIX_BYTES, PREFIX_SNAPSHOTS
from .sampling import SamplingParams
from .validate import choice_param, int_param, token_ids

MAX_CTX = 1 << 24          # far above any model's context; larger values only fail later, in the memory plan
MAX_BUDGET = 1024          # tree nodes / chain length per step
MAX_TOKENS = 1 << 24
MAX_SNAPSHOTS = 1 << 16    # saved prefix states (each one also bounded by prefix_bytes)
STATE_TYPES = ("auto", "f32", "replay", "f16")   # the verify's node states (load's state_type)
DRAFT_TYPES = ("auto", "stored", "q8_0", "q4_k")   # the draft's matrices on the device (load's draft_type)


@dataclass
class Result:
    text: str                  # the new text (an end-of-generation token is not rendered)
    tokens: list[int]          # the new token ids (an end-of-generation token that stopped it included)
    stats: dict = field(default_factory=dict)   # acceptance_length, steps, prefill_tok_s, decode_tok_s, ...


class Engine:
    """A loaded target (and draft) ready to generate. Make one with `pydflash.load`."""

    def __init__(self, decoder: Decoder, tokenizer=None):
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.last_tokens: list[int] = []   # the new token ids of the current (or last) stream, growing as it runs

    @property
    def mode(self) -> str:
        return self.decoder.mode

    @property
    def target(self):
        return self.decoder.target

    def generate(self, prompt, max_tokens: int = 256, chat: bool = False, **sampling) -> Result:
        """Generation after `prompt` (text, or a list of token ids) until max_tokens new tokens or an
        end-of-generation token. chat=True wraps a text prompt in the model's chat template as a user turn.
        sampling: temperature (0, the default: greedy), top_k, top_p, min_p, seed, repeat_penalty,
        presence_penalty, frequency_penalty (pydflash.sampling.SamplingParams; unknown names are refused)."""
        int_param("max_tokens", max_tokens, 1, MAX_TOKENS)
        params = SamplingParams.from_options(sampling)
        ids = self._prompt_ids(prompt, chat)
        tokens, stats = self.decoder.generate_ids(ids, max_tokens, sampling=params)
        return Result(self._text(tokens), tokens, stats)

    def stream(self, prompt, max_tokens: int = 256, chat: bool = False, **sampling):
        """Like `generate`, but yields text pieces as tokens are committed (a piece may hold several tokens:
        a speculative step commits many at once). The stats are in `last_stats` afterwards, also when the
        consumer stops early (closes the generator)."""
        tokens = self.last_tokens = []
        shown = ""
        batches = self.stream_tokens(prompt, max_tokens, chat, **sampling)
        try:
            for batch in batches:
                tokens.extend(batch)
                text = self._text(tokens)
                # hold back an incomplete UTF-8 sequence (rendered as U+FFFD) until its last byte arrives
                stable = text.rstrip("\ufffd")
                if len(stable) > len(shown):
                    yield stable[len(shown):]
                    shown = stable
        finally:
            batches.close()    # a consumer that stops early ends the run now (its state and stats are kept)
        text = self._text(tokens)
        if len(text) > len(shown):
            yield text[len(shown):]

    def stream_tokens(self, prompt, max_tokens: int = 256, chat: bool = False, **sampling):
        """Like `stream`, but yields the new token ids, in the batches they are committed in (the prefill's
        token first). Closing the generator early stops decoding there (its state and stats are kept)."""
        int_param("max_tokens", max_tokens, 1, MAX_TOKENS)
        params = SamplingParams.from_options(sampling)
        ids = self._prompt_ids(prompt, chat)
        steps = self.decoder.iter_generate(ids, max_tokens, params)
        try:
            yield from steps
        finally:
            steps.close()

    @property
    def last_stats(self) -> dict:
        return self.decoder.last_stats

    def reset(self) -> None:
        """Forget earlier prompts (the prefix cache): the next prompt is prefilled from scratch."""
        self.decoder.reset()

    def prompt_ids(self, prompt, chat: bool = False) -> list[int]:
        """The token ids `generate(prompt, chat=chat)` would decode after."""
        return self._prompt_ids(prompt, chat)

    def _prompt_ids(self, prompt, chat: bool) -> list[int]:
        if not isinstance(chat, bool):
            raise TypeError(f"chat = {chat!r}: expected True or False")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass the prompt as token ids")
            if not prompt:
                raise ValueError("the prompt is empty")
            if chat:
                # the user's text is plain text: only the template's own markup may become control tokens, or a
                # message holding "<|im_end|>" could forge a turn
                return self.tokenizer.chat_ids([{"role": "user", "content": prompt}])
            return self.tokenizer.tokenize(prompt, add_special=True)
        if chat:
            raise ValueError("chat=True needs a text prompt")
        return token_ids("prompt", prompt, self.target.hp.n_vocab)

    def _text(self, tokens) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.detokenize(tokens)


def draft_layer_ids(draft_path) -> list[int]:
    """The target layers a DFlash draft reads: its config's `target_layer_ids` (or z-lab's default spread when
    absent), or the header of a llama.cpp `dflash` GGUF; the same lookup the draft's loader uses. A file that
    cannot be read as a draft is a DraftLoadError."""
    from .gguf_io import GGUFError
    from .models.dflash_draft import DraftLoadError, read_draft_hparams
    try:
        return list(read_draft_hparams(draft_path).target_layer_ids)
    except GGUFError as e:
        raise DraftLoadError(str(e)) from None


def _load_draft(draft_path, target, top_k: int = 8, window: int | None = None, weight_type: str | None = None):
    try:
        from .models.dflash_draft import DFlashDraft
    except ImportError as e:
        raise RuntimeError("the DFlash draft model is not part of this build yet (pydflash.models.dflash_draft); "
                           "run with mode='ar'") from e
    return DFlashDraft(draft_path, target, top_k=top_k, window=window or DRAFT_WINDOW, weight_type=weight_type)


def load(target, draft=None, *, device: str = "auto", kv_type: str = "auto", max_ctx: int | str | None = "auto",
         mode: str | None = None, budget: int = 22, tokenizer: bool = True, progress: bool | None = None,
         n_ubatch: int | str = "auto", vram=None, verbose: bool = False, draft_window: int = DRAFT_WINDOW,
         prefix_cache: bool = True, prefix_snapshots: int = PREFIX_SNAPSHOTS,
         prefix_bytes: int | None = PREFIX_BYTES, state_type: str = "auto", draft_type: str = "auto") -> Engine:
    """Load a target GGUF (and a DFlash draft: its directory or config.json) and return an `Engine`.

    device: 'auto', 'cpu', 'cuda' or 'cuda:N'. max_ctx: positions of the KV cache; 'auto' (or None) fits the
    longest context the device's free memory holds, capped by the model's training context. kv_type: 'f16',
    'q8_0', 'q4_0', 'tq3_0', or 'auto': f16 while the context fits, then q8_0, q4_0, tq3_0 (pydflash.plan).
    A request that cannot fit is refused with the memory plan's numbers. vram: the memory to plan for (bytes
    or '24GiB'; default: the device's free memory). verbose: print the memory plan. mode: 'ar', 'chain' or
    'ddtree' (None: 'ddtree' with a draft, 'ar' without). budget: tree nodes per step (ddtree) or chain length
    (chain). n_ubatch: the longest prefill micro-batch (the target's prefill picks the size by prompt length);
    'auto': 2048 when its buffers leave the fitted context and KV type unchanged, else 512.
    draft_window: context positions the draft attends to (its ring of projected K/V; the target's captured
    features are kept for one micro-batch only, so no per-position cost grows with max_ctx besides the KV cache).
    tokenizer: load the GGUF's tokenizer (through llama-cpp-python, vocabulary only) for text in and out.
    prefix_cache: resume a prompt that extends an earlier one (a chat's next turn) from the state saved at the
    end of that prompt or of its generation, instead of prefilling it all; the saved recurrent states are kept on
    the device, at most prefix_snapshots of them and prefix_bytes in all (least recently used dropped first). The
    memory plan counts them after the context: where they would shorten the fitted context or coarsen its KV
    type, fewer are kept (none, if need be).
    state_type: the verify's per-node recurrent states: 'f32' stores every node's state (3.3 GiB for the 27B at
    budget 22); 'replay' stores only every node's key, decay and delta (~80 MiB) and the commit rebuilds the
    accepted node's state from them (the same bits); 'f16' halves the f32 store but rounds the state a
    step commits, so the output may differ from plain decoding where the top two logits are within ~1e-2
    (docs/benchmarks.md, "Long context"); 'auto' (default): replay (the smallest, and on CUDA the fastest: its
    verify computes each recurrent layer's tree at once, docs/gdn-tree-chunk.md).
    draft_type: the draft's matrices on the device: 'stored' (as in the file, bf16 for z-lab drafts), 'q8_0'
    (quantized at load, ~53% of bf16: the proposals change slightly, the output never), 'q4_k' (~28% of bf16;
    rows that are not whole 256-value blocks take q8_0; the proposals change more than with q8_0, the output
    never; on CUDA its products take ggml_qmatmul at the draft's 15-16 columns), or 'auto' (default): 'stored'
    unless q8_0 fits a longer context (or a finer KV type) in the memory plan (never q4_k)."""
    import sys

    from . import ggml, plan
    from .gguf_io import GGUFFile
    from .kv import kv_type_of
    from .models import load_target

    # cheap checks first: a bad parameter must not cost a model load
    if not isinstance(target, (str, os.PathLike)):
        raise TypeError(f"target = {target!r}: expected the path of a GGUF file")
    if draft is not None and not isinstance(draft, (str, os.PathLike, tuple, list)) and not hasattr(draft, "propose"):
        raise TypeError(f"draft = {draft!r}: expected a DFlash draft folder, config.json or GGUF path")
    if not isinstance(device, str):
        raise TypeError(f"device = {device!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if not (isinstance(kv_type, str) and kv_type == "auto"):
        kv_type_of(kv_type)
    if mode is None:
        mode = "ddtree" if draft is not None else "ar"
    choice_param("mode", mode, MODES)
    if mode != "ar" and draft is None:
        raise ValueError(f"mode {mode!r} needs a draft")
    budget = int_param("budget", budget, 1, MAX_BUDGET)
    if max_ctx is None or (isinstance(max_ctx, str) and max_ctx == "auto"):
        max_ctx = "auto"
    else:
        max_ctx = int_param("max_ctx", max_ctx, 1, MAX_CTX)
    if not (isinstance(n_ubatch, str) and n_ubatch == "auto"):
        n_ubatch = int_param("n_ubatch", n_ubatch, 1, MAX_CTX)
    draft_window = int_param("draft_window", draft_window, 1, MAX_CTX)
    for name, value in (("tokenizer", tokenizer), ("prefix_cache", prefix_cache), ("verbose", verbose)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} = {value!r}: expected True or False")
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress = {progress!r}: expected True, False or None")
    if vram is not None:
        if isinstance(vram, bool) or not isinstance(vram, (int, str)):
            raise TypeError(f"vram = {vram!r}: expected a byte count or a size such as '24GiB'")
        if plan.parse_size(vram) <= 0:
            raise ValueError(f"vram = {vram!r}: expected a positive size")
    choice_param("state_type", state_type, STATE_TYPES)
    if mode == "ar" and state_type not in ("auto", "f32"):
        raise ValueError(f"state_type {state_type!r} concerns the speculative verify; mode 'ar' does not use it")
    choice_param("draft_type", draft_type, DRAFT_TYPES)
    prefix_snapshots = int_param("prefix_snapshots", prefix_snapshots, 0, MAX_SNAPSHOTS)
    if prefix_bytes is not None:
        prefix_bytes = int_param("prefix_bytes", prefix_bytes, 0, 1 << 62)
    from .ggml.core import _find_device
    _find_device(device)
    target_file = GGUFFile(target)        # parsed once: the plan, the target class and the tokenizer get it
    if tokenizer:
        from .tokenizer import check_vocabulary
        check_vocabulary(target_file)     # before llama.cpp's vocabulary loader, which aborts on what this refuses
    draft_object = draft is not None and hasattr(draft, "propose")   # an already built draft (tests, demo)
    if mode == "ar" or draft is None:
        capture = ()
    elif draft_object:
        capture = tuple(getattr(draft, "target_layer_ids", ()))
    else:
        capture = draft_layer_ids(draft)
    backend = ggml.Backend(device)
    memory = plan.parse_size(vram) if vram is not None else backend.memory()[0]

    fitted = plan.plan_for_load(target_file, None if (draft_object or mode == "ar") else draft, vram=memory,
                                max_ctx=max_ctx, kv_type=kv_type, budget=budget,
                                n_ubatch=n_ubatch, mode=mode, draft_window=draft_window,
                                prefix_snapshots=prefix_snapshots if prefix_cache else 0, prefix_bytes=prefix_bytes,
                                state_type=state_type, draft_type=None if draft_type == "stored" else draft_type)
    n_ubatch = fitted.n_ubatch
    if verbose:
        print(fitted.table(), file=sys.stderr)
    model = load_target(target_file, backend, n_ctx=fitted.n_ctx, kv_type=fitted.kv_type, n_ubatch=n_ubatch,
                        capture_layers=capture, progress=progress)
    model.memory_plan = fitted
    draft_model = None
    if mode != "ar":
        draft_model = draft if draft_object else _load_draft(draft, model, top_k=min(budget, 8), window=draft_window,
                                                             weight_type=fitted.draft_type)
    tok = None
    if tokenizer:
        from .tokenizer import Tokenizer
        tok = Tokenizer(target, target_file)
    decoder = Decoder(model, draft_model, mode=mode, budget=budget, tokenizer=tok, state_type=fitted.state_type,
                      prefix_snapshots=fitted.prefix_snapshots if prefix_cache else 0, prefix_bytes=prefix_bytes)
    return Engine(decoder, tok)
