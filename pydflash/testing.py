"""Synthetic models for tests and benchmarks: random-weight GGUFs that llama.cpp loads.

`write_qwen35_gguf(path, **config)` writes a `qwen35` (Qwen3.5/3.6 dense hybrid) GGUF with random weights and a
small byte-level BPE vocabulary (ChatML special tokens and a chat template), so llama.cpp can load, tokenise and
template it and serve as the oracle for our graphs. Tensors are generated and written one at a time, so even the
27B-shaped preset (~16 GB) never sits in memory.

`write_llama_gguf(path, arch=..., **config)` writes a random `llama`, `qwen2` or `qwen3` (attention-only) GGUF
with the same vocabulary.

`write_dflash_draft(dir, target_gguf, **config)` writes a random DFlash draft in z-lab format (config.json +
bf16 model.safetensors) that fits a given target GGUF.

Command line: `python -m pydflash.testing write-qwen35 OUT.gguf --preset tiny|27b [--type Q8_0] [--n-layer 8 ...]`,
`python -m pydflash.testing write-llama OUT.gguf --arch qwen2 [--type Q4_K_M] [--n-layer 28 ...]` and `python -m pydflash.testing write-dflash OUT_DIR --target T.gguf [--n-layer 5 ...]`.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

# --- the tiny byte-level BPE vocabulary ------------------------------------------------------------------------

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Text the merges are learnt from: English and a little Python, so prompts in tests tokenise into real merges.
_MERGE_CORPUS = """
The quick brown fox jumps over the lazy dog. A language model predicts the next token from the tokens before it.
Speculative decoding drafts several tokens and the target model verifies them in one forward pass, which is
faster because the weights are read once. def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)
for i in range(10): print(i, fibonacci(i)) # the answer is in the output of the program
Hello, world! This is a test of the tokenizer and the chat template of the synthetic model.
import numpy as np; x = np.zeros((3, 4)); y = x + 1; print(y.sum()) while True: break
the of and to in is that for it with as was on be by this are from at an or have not but what all were when
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def tiny_bpe_vocab(n_merges: int = 200) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a byte-level BPE learnt on a fixed corpus: 256 byte tokens, then one per merge."""
    to_char = _bytes_to_unicode()
    words = Counter()
    for piece in _MERGE_CORPUS.replace("\n", " ").split(" "):
        if piece:
            words[tuple(to_char[b] for b in (" " + piece).encode())] += 1
    tokens = [to_char[b] for b in range(256)]
    merges: list[str] = []
    for _ in range(n_merges):
        pairs = Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))  # ties broken deterministically
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        merged = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return tokens, merges


# --- model configuration ---------------------------------------------------------------------------------------

WEIGHT_TYPES = ("F32", "F16", "Q8_0", "Q4_K", "Q4_K_M")


@dataclass
class Qwen35Config:
    """Every size of a qwen35 model. Defaults are a tiny CI model; `preset_27b()` is the Qwen3.5-27B shape."""
    n_layer: int = 4
    n_embd: int = 64
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64                 # attention key/value length per head
    n_rot: int = 16                    # rotated dims per head (IMROPE)
    rope_sections: tuple = (3, 3, 2, 0)  # sum = n_rot/2
    rope_base: float = 1e7
    ssm_d_state: int = 16              # GDN head dim (k and v)
    ssm_n_group: int = 2               # GDN k/q heads
    ssm_dt_rank: int = 4               # GDN v heads
    ssm_d_conv: int = 4
    full_attention_interval: int = 4
    recurrent_layers: tuple | None = None  # explicit bools per layer; overrides the interval
    n_merges: int = 200                # BPE merges learnt: the vocabulary has 256 + n_merges + 3 special tokens
    n_vocab: int | None = None         # pad the vocabulary to this many tokens with placeholders <|extra_N|>
    n_ctx_train: int = 4096
    rms_eps: float = 1e-6
    logit_std: float = 2.0             # spread of the logits (output.weight std * sqrt(n_embd)); larger: peakier
    weight_type: str = "F32"
    seed: int = 0
    depth_scale_layers: int | None = None  # depth used to scale residual-branch outputs (default n_layer)
    name: str = "pydflash-synthetic-qwen35"
    chat_template: str = CHATML_TEMPLATE

    def is_recurrent(self, il: int) -> bool:
        if self.recurrent_layers is not None:
            return bool(self.recurrent_layers[il])
        return (il + 1) % self.full_attention_interval != 0


def preset_tiny(**overrides) -> Qwen35Config:
    return replace(Qwen35Config(), **overrides)


def preset_27b(**overrides) -> Qwen35Config:
    """The Qwen3.5-27B shape (64 layers, 5120 wide, 248320 vocab), Q4_K_M-like types (~16 GB)."""
    cfg = Qwen35Config(n_layer=64, n_embd=5120, n_ff=17408, n_head=24, n_head_kv=4, head_dim=256, n_rot=64,
                       rope_sections=(11, 11, 10, 0), ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=48,
                       ssm_d_conv=4, full_attention_interval=4, n_ctx_train=262144, weight_type="Q4_K_M",
                       n_vocab=248320)
    return replace(cfg, **overrides)


PRESETS = {"tiny": preset_tiny, "27b": preset_27b}


# --- tensors ---------------------------------------------------------------------------------------------------

@dataclass
class _TensorSpec:
    name: str
    ne: tuple                          # ggml order, ne[0] contiguous
    kind: str                          # "matrix" (quantisable weight), "norm", or "raw" (always f32)
    make: Callable[[np.random.Generator], np.ndarray]  # returns f32 array shaped ne[::-1]
    std: float = 0.0                   # of a Gaussian matrix's entries


def _tensor_specs(cfg: Qwen35Config, n_vocab: int) -> list[_TensorSpec]:
    E, L = cfg.n_embd, cfg.n_layer
    # Weights are scaled so the residual stream stays O(1) for any depth: inputs ~ 1/sqrt(fan_in), outputs of
    # each residual branch further by 1/sqrt(2 L).
    out_scale = 1.0 / np.sqrt(2.0 * (cfg.depth_scale_layers or L))

    def gauss(shape, std):
        return lambda rng: (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    def norm(n):
        return lambda rng: (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    def mat(name, n_in, n_out, std=None, out=False):
        std = (1.0 / np.sqrt(n_in)) * (out_scale if out else 1.0) if std is None else std
        return _TensorSpec(name, (n_in, n_out), "matrix", gauss((n_out, n_in), std), std)

    specs = [_TensorSpec("token_embd.weight", (E, n_vocab), "matrix", gauss((n_vocab, E), 1.0), 1.0),
             _TensorSpec("output_norm.weight", (E,), "norm", norm(E))]
    specs.append(mat("output.weight", E, n_vocab, std=cfg.logit_std / np.sqrt(E)))
    d_k, h_k, h_v = cfg.ssm_d_state, cfg.ssm_n_group, cfg.ssm_dt_rank
    key_dim, value_dim = d_k * h_k, d_k * h_v
    conv_dim = 2 * key_dim + value_dim
    for il in range(L):
        p = f"blk.{il}."
        specs += [_TensorSpec(p + "attn_norm.weight", (E,), "norm", norm(E)),
                  _TensorSpec(p + "post_attention_norm.weight", (E,), "norm", norm(E))]
        if cfg.is_recurrent(il):
            specs += [
                mat(p + "attn_qkv.weight", E, conv_dim),
                mat(p + "attn_gate.weight", E, value_dim),
                _TensorSpec(p + "ssm_conv1d.weight", (cfg.ssm_d_conv, conv_dim), "raw",
                            gauss((conv_dim, cfg.ssm_d_conv), 0.5)),
                _TensorSpec(p + "ssm_dt.bias", (h_v,), "raw", gauss((h_v,), 0.5)),
                # stored as -exp(A_log) = -A with A in [1, 8): a decay rate per v head
                _TensorSpec(p + "ssm_a", (h_v,), "raw",
                            lambda rng, n=h_v: -rng.uniform(1.0, 8.0, n).astype(np.float32)),
                mat(p + "ssm_beta.weight", E, h_v),
                mat(p + "ssm_alpha.weight", E, h_v),
                _TensorSpec(p + "ssm_norm.weight", (d_k,), "norm", norm(d_k)),
                mat(p + "ssm_out.weight", value_dim, E, out=True),
            ]
        else:
            hd = cfg.head_dim
            specs += [
                mat(p + "attn_q.weight", E, hd * cfg.n_head * 2),  # per head [Q | gate]
                mat(p + "attn_k.weight", E, hd * cfg.n_head_kv),
                mat(p + "attn_v.weight", E, hd * cfg.n_head_kv),
                mat(p + "attn_output.weight", hd * cfg.n_head, E, out=True),
                _TensorSpec(p + "attn_q_norm.weight", (hd,), "norm", norm(hd)),
                _TensorSpec(p + "attn_k_norm.weight", (hd,), "norm", norm(hd)),
            ]
        specs += [mat(p + "ffn_gate.weight", E, cfg.n_ff), mat(p + "ffn_up.weight", E, cfg.n_ff),
                  mat(p + "ffn_down.weight", cfg.n_ff, E, out=True)]
    return specs


def _storage_type(spec: _TensorSpec, weight_type: str) -> str:
    """The GGUF type a tensor is stored as: 1-D tensors and the conv kernel stay f32, like llama.cpp's quantiser."""
    from .ggml import Type, row_size

    def fits(t):
        try:
            row_size(Type[t], spec.ne[0])
            return True
        except ValueError:
            return False

    if spec.kind != "matrix":
        return "F32"
    wt = weight_type
    if wt == "Q4_K_M":  # llama.cpp's Q4_K_M keeps the LM head, V and FFN-down in higher precision
        wt = "Q6_K" if spec.name.startswith("output.") or spec.name.endswith(("ffn_down.weight",
                                                                                "attn_v.weight")) else "Q4_K"
    if not fits(wt):
        # a row that does not fill whole blocks: fall back to the next type that fits (as llama.cpp does)
        return "Q8_0" if fits("Q8_0") else "F16"
    return wt


def _encode(values: np.ndarray, type_name: str) -> np.ndarray:
    from .ggml import Type, quantize
    if type_name == "F32":
        return np.ascontiguousarray(values, dtype=np.float32)
    if type_name == "F16":
        return values.astype(np.float16)
    return quantize(Type[type_name], values)


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


# Matrices larger than this are built from blocks drawn out of a pool of pre-encoded random rows, so the
# 27B preset writes in minutes instead of spending an hour in the quantiser; the values are still random. Each
# row takes every block from an independently drawn pool row (quantised blocks carry their own scales), so no
# two rows are equal: equal LM-head rows would give tokens exactly equal logits, and every greedy choice a tie.
_POOL_THRESHOLD = 4 << 20    # elements
_POOL_ROWS = 4096


def _write_tensor_data(writer, spec: _TensorSpec, type_name: str, seed: int, pools: dict) -> None:
    rng = np.random.default_rng(_seed_of(seed, spec.name))
    n_elems = int(np.prod(spec.ne))
    if spec.kind != "matrix" or n_elems <= _POOL_THRESHOLD:
        writer.write_tensor_data(_encode(spec.make(rng), type_name))
        return
    n_in, n_rows = spec.ne[0], int(np.prod(spec.ne[1:]))
    std = spec.std
    key = (n_in, type_name, round(std, 9))
    if key not in pools:
        pool_rng = np.random.default_rng(_seed_of(seed, repr(key)))
        rows = pool_rng.standard_normal((_POOL_ROWS, n_in), dtype=np.float32) * np.float32(std)
        pools[key] = _encode(rows, type_name).reshape(_POOL_ROWS, -1)
    pool = pools[key]
    # the writer's own bookkeeping for this tensor, as write_tensor_data does it, then the rows in pieces
    info = writer.tensors[0].pop(spec.name)
    assert info.nbytes == pool.shape[1] * n_rows
    fout = writer.fout[0]
    writer.write_padding(fout, fout.tell())
    from .ggml import Type, block_size
    n_blocks = n_in // block_size(Type[type_name])
    blocks = pool.reshape(_POOL_ROWS, n_blocks, -1)
    chunk = max(1, (256 << 20) // pool.shape[1])   # write ~256 MB at a time
    for start in range(0, n_rows, chunk):
        idx = rng.integers(0, _POOL_ROWS, (min(chunk, n_rows - start), n_blocks))
        blocks[idx, np.arange(n_blocks)].tofile(fout)
    writer.write_padding(fout, info.nbytes)


def write_qwen35_gguf(path, config: Qwen35Config | None = None, *, progress: bool = False, data: bool = True,
                      **overrides) -> Qwen35Config:
    """Write a random-weight qwen35 GGUF to `path`; sizes come from `config` (default: tiny) and `overrides`.

    data=False writes the header and tensor table only and extends the file to its full size as a hole (a
    sparse file): header readers (e.g. pydflash.plan) see a valid 27B-shaped file that takes no disk or time.

    Returns the configuration used. The vocabulary is the tiny byte-level BPE plus ChatML specials, padded to
    `n_vocab` with placeholder control tokens `<|extra_N|>` when that is larger.
    """
    import gguf

    cfg = replace(config or Qwen35Config(), **overrides)
    if cfg.weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type {cfg.weight_type!r}: expected one of {WEIGHT_TYPES}")
    if cfg.recurrent_layers is not None and len(cfg.recurrent_layers) != cfg.n_layer:
        raise ValueError(f"recurrent_layers has {len(cfg.recurrent_layers)} entries for {cfg.n_layer} layers")
    if 2 * sum(cfg.rope_sections) != cfg.n_rot:
        raise ValueError(f"rope_sections {cfg.rope_sections} must sum to n_rot/2 = {cfg.n_rot // 2}")

    vocab = _Vocab(cfg.n_merges, cfg.n_vocab)
    n_vocab = vocab.n_vocab

    arch = "qwen35"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(cfg.name)
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_dimension_count(cfg.n_rot)
    w.add_array(f"{arch}.rope.dimension_sections", [int(s) for s in cfg.rope_sections])
    w.add_rope_freq_base(cfg.rope_base)
    w.add_uint32(f"{arch}.ssm.conv_kernel", cfg.ssm_d_conv)
    w.add_uint32(f"{arch}.ssm.inner_size", cfg.ssm_d_state * cfg.ssm_dt_rank)
    w.add_uint32(f"{arch}.ssm.state_size", cfg.ssm_d_state)
    w.add_uint32(f"{arch}.ssm.time_step_rank", cfg.ssm_dt_rank)
    w.add_uint32(f"{arch}.ssm.group_count", cfg.ssm_n_group)
    if cfg.recurrent_layers is not None:
        w.add_array(f"{arch}.attention.recurrent_layers", [bool(x) for x in cfg.recurrent_layers])
    else:
        w.add_uint32(f"{arch}.full_attention_interval", cfg.full_attention_interval)
    # llama_ftype: ALL_F32 0, MOSTLY_F16 1, MOSTLY_Q8_0 7, MOSTLY_Q4_K_S 14, MOSTLY_Q4_K_M 15
    w.add_file_type({"F32": 0, "F16": 1, "Q8_0": 7, "Q4_K": 14, "Q4_K_M": 15}[cfg.weight_type])

    vocab.add_to(w, cfg.chat_template)
    _write_tensors(w, path, _tensor_specs(cfg, n_vocab), cfg.weight_type, cfg.seed, progress, data)
    return cfg


class _Vocab:
    """The tiny byte-level BPE vocabulary plus ChatML specials, padded with <|extra_N|> control tokens."""

    def __init__(self, n_merges: int, n_vocab: int | None):
        tokens, self.merges = tiny_bpe_vocab(n_merges)
        n_normal = len(tokens)
        tokens = tokens + list(SPECIAL_TOKENS)
        self.n_vocab = max(len(tokens), int(n_vocab or 0))
        self.tokens = tokens + [f"<|extra_{i}|>" for i in range(self.n_vocab - len(tokens))]
        self.token_types = [1] * n_normal + [3] * (self.n_vocab - n_normal)   # NORMAL, then CONTROL

    def add_to(self, w, chat_template: str) -> None:
        tok_id = {t: i for i, t in enumerate(self.tokens)}
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(self.tokens)
        w.add_token_types(self.token_types)
        w.add_token_merges(self.merges)
        w.add_bos_token_id(tok_id["<|endoftext|>"])
        w.add_eos_token_id(tok_id["<|im_end|>"])
        w.add_pad_token_id(tok_id["<|endoftext|>"])
        w.add_add_bos_token(False)
        w.add_chat_template(chat_template)


def _write_tensors(w, path, specs: list[_TensorSpec], weight_type: str, seed: int, progress: bool,
                   data: bool = True) -> None:
    """Write the tensor table and the data of `specs` (after the metadata), then close the writer. data=False:
    no data, the file extended to its full size as a hole (write_qwen35_gguf's header-only files)."""
    import gguf
    from .ggml import Type, row_size

    types = [_storage_type(s, weight_type) for s in specs]
    for spec, tname in zip(specs, types):
        nbytes = row_size(Type[tname], spec.ne[0]) * int(np.prod(spec.ne[1:]))
        w.add_tensor_info(spec.name, list(spec.ne[::-1]), np.dtype(np.float32), nbytes,
                          raw_dtype=gguf.GGMLQuantizationType[tname])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    if not data:
        align = w.data_alignment
        start = -(-w.fout[0].tell() // align) * align
        sizes = [row_size(Type[t], s.ne[0]) * int(np.prod(s.ne[1:])) for s, t in zip(specs, types)]
        w.close()
        os.truncate(path, start + sum(-(-n // align) * align for n in sizes))
        return
    pools: dict = {}
    for i, (spec, tname) in enumerate(zip(specs, types)):
        _write_tensor_data(w, spec, tname, seed, pools)
        w.state = gguf.gguf_writer.WriterState.WEIGHTS
        if progress:
            print(f"\r{i + 1}/{len(specs)} tensors", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    w.close()


# --- attention-only architectures (llama, qwen2, qwen3) ------------------------------------------------------

ATTENTION_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
# the weight types of the real files these architectures come in, plus the ones above
ATTENTION_WEIGHT_TYPES = WEIGHT_TYPES + ("Q4_0", "Q4_1", "Q5_0", "Q5_K", "Q6_K", "BF16")


@dataclass
class LlamaConfig:
    """Every size of a llama-family (attention-only) model; defaults are a tiny CI model.

    qwen2 adds Q/K/V biases, qwen3 per-head Q/K norms (and usually a head size other than n_embd / n_head),
    gemma3 Q/K norms, post-attention/post-FFN norms and sliding-window layers (at least 6 layers)."""
    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 64
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int | None = None        # None: n_embd / n_head (the key is written only when it differs)
    rope_base: float = 10000.0
    n_merges: int = 200
    n_vocab: int | None = None
    n_ctx_train: int = 4096
    rms_eps: float = 1e-5
    weight_type: str = "F32"
    tie_embeddings: bool = False       # no output.weight: the LM head is the token embedding
    seed: int = 0
    name: str = "pydflash-synthetic"
    chat_template: str = CHATML_TEMPLATE
    sliding_window: int = 8            # gemma3 only: the local layers' window (small, so short prompts cross it)


def _llama_tensor_specs(cfg: LlamaConfig, n_vocab: int) -> list[_TensorSpec]:
    E, L = cfg.n_embd, cfg.n_layer
    hd = cfg.head_dim or E // cfg.n_head
    q_dim, kv_dim = hd * cfg.n_head, hd * cfg.n_head_kv
    out_scale = 1.0 / np.sqrt(2.0 * L)

    def gauss(shape, std):
        return lambda rng: (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    def norm(name, n):
        return _TensorSpec(name, (n,), "norm",
                           lambda rng: (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32))

    def mat(name, n_in, n_out, std=None, out=False):
        std = (1.0 / np.sqrt(n_in)) * (out_scale if out else 1.0) if std is None else std
        return _TensorSpec(name, (n_in, n_out), "matrix", gauss((n_out, n_in), std), std)

    # a tied LM head is the embedding itself: scale it like a head so the logits stay O(1..10)
    emb_std = 2.0 / np.sqrt(E) if cfg.tie_embeddings else 1.0
    specs = [_TensorSpec("token_embd.weight", (E, n_vocab), "matrix", gauss((n_vocab, E), emb_std), emb_std),
             norm("output_norm.weight", E)]
    if not cfg.tie_embeddings:
        specs.append(mat("output.weight", E, n_vocab, std=2.0 / np.sqrt(E)))
    for il in range(L):
        p = f"blk.{il}."
        specs += [norm(p + "attn_norm.weight", E), mat(p + "attn_q.weight", E, q_dim),
                  mat(p + "attn_k.weight", E, kv_dim), mat(p + "attn_v.weight", E, kv_dim)]
        if cfg.arch == "qwen2":
            specs += [_TensorSpec(p + f"attn_{x}.bias", (n,), "raw", gauss((n,), 0.5))
                      for x, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))]
        if cfg.arch in ("qwen3", "gemma3"):
            specs += [norm(p + "attn_q_norm.weight", hd), norm(p + "attn_k_norm.weight", hd)]
        if cfg.arch == "gemma3":
            specs += [norm(p + "post_attention_norm.weight", E), norm(p + "post_ffw_norm.weight", E)]
        specs += [mat(p + "attn_output.weight", q_dim, E, out=True), norm(p + "ffn_norm.weight", E),
                  mat(p + "ffn_gate.weight", E, cfg.n_ff), mat(p + "ffn_up.weight", E, cfg.n_ff),
                  mat(p + "ffn_down.weight", cfg.n_ff, E, out=True)]
    return specs


def write_llama_gguf(path, config: LlamaConfig | None = None, *, progress: bool = False, **overrides) -> LlamaConfig:
    """Write a random-weight llama / qwen2 / qwen3 / gemma3 GGUF (config.arch) to `path`, with the tiny BPE vocabulary of
    `write_qwen35_gguf`. Returns the configuration used."""
    import gguf

    cfg = replace(config or LlamaConfig(), **overrides)
    if cfg.arch not in ATTENTION_ARCHS:
        raise ValueError(f"arch {cfg.arch!r}: expected one of {ATTENTION_ARCHS}")
    if cfg.weight_type not in ATTENTION_WEIGHT_TYPES:
        raise ValueError(f"weight_type {cfg.weight_type!r}: expected one of {ATTENTION_WEIGHT_TYPES}")
    vocab = _Vocab(cfg.n_merges, cfg.n_vocab)
    w = gguf.GGUFWriter(str(path), cfg.arch)
    w.add_name(cfg.name)
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    if cfg.head_dim:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_base)
    if cfg.arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    vocab.add_to(w, cfg.chat_template)
    _write_tensors(w, path, _llama_tensor_specs(cfg, vocab.n_vocab), cfg.weight_type, cfg.seed, progress)
    return cfg


# --- DFlash drafts ----------------------------------------------------------------------------------------------

def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even like torch's .to(torch.bfloat16)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)  # finite inputs


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


_ST_DTYPES = {np.dtype(np.uint16): "BF16", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32",
              np.dtype(np.float64): "F64", np.dtype(np.int32): "I32"}


def write_safetensors(path, tensors: dict, metadata: dict | None = None, data: bool = True) -> None:
    """Write named arrays; uint16 arrays are written as BF16 bit patterns, float arrays as F32/F16/F64.

    Values may also be (dtype, shape, make) triples: make() is called when the tensor is written, so large
    files are streamed one tensor at a time. data=False: the header and a sparse file of the full size (memory
    plans read headers only)."""
    import json
    specs = {}
    for name, value in tensors.items():
        if isinstance(value, tuple):
            specs[name] = (np.dtype(value[0]), tuple(value[1]), value[2])
        else:
            arr = np.ascontiguousarray(value)
            specs[name] = (arr.dtype, arr.shape, lambda arr=arr: arr)
    header, offset = {}, 0
    for name, (dtype, shape, _) in specs.items():
        nbytes = dtype.itemsize * int(np.prod(shape))
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        if not data:
            f.truncate(8 + len(raw) + offset)
            return
        for name, (dtype, shape, make) in specs.items():
            arr = np.ascontiguousarray(make())
            assert arr.dtype == dtype and arr.shape == shape, name
            arr.tofile(f)


def write_dflash_draft(out_dir, target_gguf, *, n_layer: int = 2, n_head: int = 4, n_head_kv: int = 2,
                       head_dim: int = 64, n_ff: int = 128, block_size: int = 16, rope_theta: float = 1e7,
                       rms_eps: float = 1e-6, mask_token_id: int | None = None, target_layer_ids=None,
                       layer_types=None, sliding_window: int | None = None, seed: int = 0,
                       dtype: str = "BF16", data: bool = True) -> dict:
    """Write a random DFlash draft in z-lab format (config.json + model.safetensors) that fits `target_gguf`.

    Hidden size and vocabulary come from the target; the mask token defaults to the target's last token id and
    the captured layers to ids spread over its depth. Tensors are generated while being written, so the 27B
    draft shape (3.5 GB) never sits in memory whole. data=False writes the safetensors header and a sparse file
    (for memory plans). Returns the config written."""
    import json
    import os
    from .gguf_io import GGUFFile
    from .train_draft import draft_config   # the config format, shared with train-draft

    cfg = draft_config(GGUFFile(target_gguf), n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
                       head_dim=head_dim, n_ff=n_ff, block_size=block_size, rope_theta=rope_theta, rms_eps=rms_eps,
                       mask_token_id=mask_token_id, target_layer_ids=target_layer_ids)
    n_embd, target_layer_ids = cfg["hidden_size"], cfg["dflash_config"]["target_layer_ids"]
    if layer_types is not None:
        cfg["layer_types"] = list(layer_types)
        cfg["use_sliding_window"] = True
        cfg["sliding_window"] = int(sliding_window or 64)
    E, L = n_embd, n_layer
    out_scale = 1.0 / np.sqrt(2.0 * L)
    encode = {"BF16": (np.uint16, bf16_bits), "F16": (np.float16, lambda a: a.astype(np.float16)),
              "F32": (np.float32, lambda a: a)}[dtype]
    specs = {}

    def mat(name, n_out, n_in, scale=1.0):    # torch layout [out, in], entries ~ N(0, scale^2 / n_in)
        def make():
            rng = np.random.default_rng(_seed_of(seed, name))
            return encode[1](rng.standard_normal((n_out, n_in), dtype=np.float32) * np.float32(scale / np.sqrt(n_in)))
        specs[name] = (encode[0], (n_out, n_in), make)

    def norm(name, n):
        def make():
            rng = np.random.default_rng(_seed_of(seed, name))
            return encode[1]((1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32))
        specs[name] = (encode[0], (n,), make)

    mat("fc.weight", E, E * len(target_layer_ids))
    norm("hidden_norm.weight", E)
    norm("norm.weight", E)
    for il in range(L):
        p = f"layers.{il}."
        norm(p + "input_layernorm.weight", E)
        norm(p + "post_attention_layernorm.weight", E)
        mat(p + "self_attn.q_proj.weight", n_head * head_dim, E)
        mat(p + "self_attn.k_proj.weight", n_head_kv * head_dim, E)
        mat(p + "self_attn.v_proj.weight", n_head_kv * head_dim, E)
        mat(p + "self_attn.o_proj.weight", E, n_head * head_dim, out_scale)
        norm(p + "self_attn.q_norm.weight", head_dim)
        norm(p + "self_attn.k_norm.weight", head_dim)
        mat(p + "mlp.gate_proj.weight", n_ff, E)
        mat(p + "mlp.up_proj.weight", n_ff, E)
        mat(p + "mlp.down_proj.weight", E, n_ff, out_scale)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), specs, {"format": "pt"}, data)
    return cfg


def write_dflash_gguf(path, draft_dir) -> None:
    """Convert a z-lab draft folder to llama.cpp's `dflash` GGUF layout (keys and names of its converter)."""
    import json
    import os
    import gguf
    from .models.dflash_draft import _gguf_names, read_safetensors_header

    with open(os.path.join(draft_dir, "config.json")) as f:
        cfg = json.load(f)
    tensors, mm = read_safetensors_header(os.path.join(draft_dir, "model.safetensors"))
    dcfg = cfg["dflash_config"]
    w = gguf.GGUFWriter(str(path), "dflash")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_uint32("dflash.block_size", cfg["block_size"])
    w.add_array("dflash.target_layers", [i + 1 for i in dcfg["target_layer_ids"]])   # llama.cpp: lid + 1
    w.add_uint32("tokenizer.ggml.mask_token_id", dcfg["mask_token_id"])
    if cfg.get("layer_types"):
        w.add_uint32("dflash.attention.sliding_window", cfg["sliding_window"])
        w.add_array("dflash.attention.sliding_window_pattern",
                    [t == "sliding_attention" for t in cfg["layer_types"]])
    zlab_to_gguf = {z: g for g, z in _gguf_names(int(cfg["num_hidden_layers"])).items()}
    for zname, info in tensors.items():
        raw = np.asarray(mm[info.offset: info.offset + info.nbytes])
        shape = list(info.ne[::-1])
        qtype = {"BF16": gguf.GGMLQuantizationType.BF16, "F16": gguf.GGMLQuantizationType.F16,
                 "F32": gguf.GGMLQuantizationType.F32}[info.type.name]
        w.add_tensor(zlab_to_gguf[zname], raw.reshape(shape[:-1] + [-1]), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# --- command line ----------------------------------------------------------------------------------------------

class OracleDraft:
    """A draft test double that knows the answer: it proposes the target's own greedy continuation `reference`
    (prompt + AR output, token ids), except at `error_positions` (indices into `reference`), where its top
    proposal is a wrong token and the right one comes second. So deep paths get accepted, and where each step
    must stop is known in advance. It implements the engine's draft interface (see pydflash.engine)."""

    def __init__(self, reference, n_vocab: int, *, block_size: int = 16, error_positions=()):
        if n_vocab < 3:
            raise ValueError("the oracle needs a vocabulary of at least 3 tokens")
        self.reference = [int(t) for t in reference]
        self.n_vocab, self.block_size = n_vocab, block_size
        self.error_positions = frozenset(int(p) for p in error_positions)
        self.n_context = 0               # context positions received so far (must arrive in order)
        self.calls = 0

    def reset(self) -> None:
        self.n_context = 0
        self.calls = 0

    def truncate(self, n: int) -> bool:
        if not 0 <= n <= self.n_context:
            raise AssertionError(f"truncate to {n}: the draft context holds {self.n_context} positions")
        self.n_context = n
        return True

    def append_context(self, target, first_position: int, slots) -> None:
        if first_position != self.n_context:
            raise AssertionError(f"draft context at {self.n_context}, got features for position {first_position}")
        self.n_context += len(slots)

    def propose(self, tokens, k: int):
        self.calls += 1
        n = len(tokens)                  # the root is tokens[n-1]; depth d predicts position n-1+d
        if self.n_context != n - 1:
            raise AssertionError(f"draft context has {self.n_context} positions, {n - 1} tokens are committed")
        depth = self.block_size - 1
        ids = np.zeros((depth, k), np.int64)
        logp = np.zeros((depth, k), np.float32)
        for d in range(1, depth + 1):
            pos = n - 1 + d
            true = self.reference[pos] if pos < len(self.reference) else 0
            wrong = [(true + 1 + j) % self.n_vocab for j in range(k)]
            ranked = [wrong[0], true] + wrong[1:] if pos in self.error_positions else [true] + wrong
            ids[d - 1] = ranked[:k]
            # confident where right, torn between the two first where wrong; tail ranks far below
            top = [-0.6, -0.8] if pos in self.error_positions else [-0.05, -3.0]
            logp[d - 1] = (top + [-4.0 - j for j in range(k)])[:k]
        return logp, ids


def synthetic_pair(out_dir, *, seed: int = 0) -> tuple[str, str]:
    """A tiny random target GGUF and a DFlash draft that fits it, written into `out_dir` (reused when already
    there): (target path, draft directory). What examples/ run on when no model is given."""
    import os
    os.makedirs(out_dir, exist_ok=True)
    target, draft = os.path.join(out_dir, "target.gguf"), os.path.join(out_dir, "draft")
    if not os.path.exists(target):
        write_qwen35_gguf(target, seed=seed)
    if not os.path.exists(os.path.join(draft, "model.safetensors")):
        write_dflash_draft(draft, target, seed=seed + 1)
    return target, draft


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pydflash.testing", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    wq = sub.add_parser("write-qwen35", help="write a random-weight qwen35 GGUF")
    wq.add_argument("out")
    wq.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    wq.add_argument("--type", dest="weight_type", choices=WEIGHT_TYPES)
    for name in ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "n_rot", "ssm_d_state",
                 "ssm_n_group", "ssm_dt_rank", "ssm_d_conv", "full_attention_interval", "n_merges", "n_vocab",
                 "seed"):
        wq.add_argument("--" + name.replace("_", "-"), dest=name, type=int)
    wq.add_argument("--rope-sections", type=lambda s: tuple(int(x) for x in s.split(",")))
    wq.add_argument("--recurrent-layers", type=lambda s: tuple(c == "1" for c in s),
                    help="one 0/1 per layer, 1 = Gated DeltaNet (overrides --full-attention-interval)")
    wl = sub.add_parser("write-llama", help="write a random-weight llama / qwen2 / qwen3 GGUF")
    wl.add_argument("out")
    wl.add_argument("--arch", choices=ATTENTION_ARCHS, default="llama")
    wl.add_argument("--type", dest="weight_type", choices=ATTENTION_WEIGHT_TYPES)
    for name in ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "n_vocab", "seed"):
        wl.add_argument("--" + name.replace("_", "-"), dest=name, type=int)
    wl.add_argument("--tie-embeddings", action="store_true", default=None)
    wd = sub.add_parser("write-dflash", help="write a random DFlash draft (z-lab format) fitting a target GGUF")
    wd.add_argument("out", help="output folder (config.json + model.safetensors)")
    wd.add_argument("--target", required=True, help="the target GGUF the draft must fit")
    for name in ("n_layer", "n_head", "n_head_kv", "head_dim", "n_ff", "block_size", "mask_token_id", "seed"):
        wd.add_argument("--" + name.replace("_", "-"), dest=name, type=int)
    wd.add_argument("--rope-theta", type=float)
    wd.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")])
    args = vars(parser.parse_args(argv))
    cmd, out = args.pop("cmd"), args.pop("out")
    if cmd == "write-dflash":
        target = args.pop("target")
        cfg = write_dflash_draft(out, target, **{k: v for k, v in args.items() if v is not None})
        print(f"wrote {out}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
              f"target layers {cfg['dflash_config']['target_layer_ids']}")
        return 0
    if cmd == "write-llama":
        cfg = write_llama_gguf(out, progress=True, **{k: v for k, v in args.items() if v is not None})
        print(f"wrote {out}: {cfg.arch}, {cfg.n_layer} layers, n_embd {cfg.n_embd}, {cfg.weight_type}")
        return 0
    preset = args.pop("preset")
    overrides = {k: v for k, v in args.items() if v is not None}
    cfg = write_qwen35_gguf(out, PRESETS[preset](), progress=True, **overrides)
    print(f"wrote {out}: {cfg.n_layer} layers, n_embd {cfg.n_embd}, {cfg.weight_type}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
