"""Synthetic models for tests and benchmarks: random-weight GGUFs that llama.cpp loads.

`write_qwen35_gguf(path, **config)` writes a `qwen35` (Qwen3.5/3.6 dense hybrid) GGUF with random weights and a
small byte-level BPE vocabulary (ChatML special tokens and a chat template), so llama.cpp can load, tokenise and
template it and serve as the oracle for our graphs. Tensors are generated and written one at a time, so even the
27B-shaped preset (~16 GB) never sits in memory.

Command line: `python -m pydflash.testing write-qwen35 OUT.gguf --preset tiny|27b [--type Q8_0] [--n-layer 8 ...]`.
"""
from __future__ import annotations

import argparse
import hashlib
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
    specs.append(mat("output.weight", E, n_vocab, std=2.0 / np.sqrt(E)))
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


# Matrices larger than this are built from rows drawn out of a pool of pre-encoded random rows, so the
# 27B preset writes in minutes instead of spending an hour in the quantiser; the values are still random.
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
    chunk = max(1, (256 << 20) // pool.shape[1])   # write ~256 MB at a time
    for start in range(0, n_rows, chunk):
        idx = rng.integers(0, _POOL_ROWS, min(chunk, n_rows - start))
        pool[idx].tofile(fout)
    writer.write_padding(fout, info.nbytes)


def write_qwen35_gguf(path, config: Qwen35Config | None = None, *, progress: bool = False, **overrides) -> Qwen35Config:
    """Write a random-weight qwen35 GGUF to `path`; sizes come from `config` (default: tiny) and `overrides`.

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

    tokens, merges = tiny_bpe_vocab(cfg.n_merges)
    n_normal = len(tokens)
    tokens = tokens + list(SPECIAL_TOKENS)
    n_vocab = max(len(tokens), int(cfg.n_vocab or 0))
    tokens += [f"<|extra_{i}|>" for i in range(n_vocab - len(tokens))]
    token_types = [1] * n_normal + [3] * (n_vocab - n_normal)   # NORMAL, then CONTROL
    tok_id = {t: i for i, t in enumerate(tokens)}

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

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tok_id["<|endoftext|>"])
    w.add_eos_token_id(tok_id["<|im_end|>"])
    w.add_pad_token_id(tok_id["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(cfg.chat_template)

    specs = _tensor_specs(cfg, n_vocab)
    from .ggml import Type, row_size
    types = [_storage_type(s, cfg.weight_type) for s in specs]
    for spec, tname in zip(specs, types):
        nbytes = row_size(Type[tname], spec.ne[0]) * int(np.prod(spec.ne[1:]))
        w.add_tensor_info(spec.name, list(spec.ne[::-1]), np.dtype(np.float32), nbytes,
                          raw_dtype=gguf.GGMLQuantizationType[tname])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    pools: dict = {}
    for i, (spec, tname) in enumerate(zip(specs, types)):
        _write_tensor_data(w, spec, tname, cfg.seed, pools)
        w.state = gguf.gguf_writer.WriterState.WEIGHTS
        if progress:
            print(f"\r{i + 1}/{len(specs)} tensors", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    w.close()
    return cfg


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
    args = vars(parser.parse_args(argv))
    cmd, out, preset = args.pop("cmd"), args.pop("out"), args.pop("preset")
    assert cmd == "write-qwen35"
    overrides = {k: v for k, v in args.items() if v is not None}
    cfg = write_qwen35_gguf(out, PRESETS[preset](), progress=True, **overrides)
    print(f"wrote {out}: {cfg.n_layer} layers, n_embd {cfg.n_embd}, {cfg.weight_type}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
