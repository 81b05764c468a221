"""`pydflash train-draft`: train a DFlash draft for a GGUF target on the quantized target's own outputs.

A DFlash draft predicts the next block_size - 1 tokens from the target's hidden states (the outputs of a few
target layers) and the last committed token. z-lab trains drafts against BF16 Hugging Face targets; a draft that
runs beside a Q4_K_M GGUF then sees features it never saw in training. Here the data comes from pydflash's own
target graph on the very GGUF file the draft will serve:

1. `collect`: for each training prompt, the target's greedy continuation (AR decoding), then one prefill of
   prompt + continuation that captures the draft's target layers for every position. Each sequence is saved
   as an .npz shard (tokens int32, features f16), so collection resumes where it stopped.
2. `train`: z-lab's PyTorch draft model (PyPI `dflash`; torch is an optional dependency: `pip install
   pydflash[train]`) learns, for random anchor positions a, to predict tokens a+1..a+B-1 of a sequence from the
   features of positions 0..a-1 and the token at a. The target's embedding and LM head are frozen (dequantized
   from the GGUF). Checkpoints (model, optimizer, step, sampler state) make it resumable.
3. `save_draft` writes z-lab's format (config.json + model.safetensors, bf16), which `pydflash.load` and z-lab's
   reference both read; `held_out_acceptance` decodes held-out prompts with pydflash's DDTree engine.
Inference never imports torch: only this module does, and only inside the functions that train.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from .gguf_io import GGUFFile

CHECKPOINT = "checkpoint.pt"


def draft_config(target_gguf, *, n_layer: int = 2, n_head: int = 4, n_head_kv: int = 2, head_dim: int = 64,
                 n_ff: int = 128, block_size: int = 16, rope_theta: float = 1e7, rms_eps: float = 1e-6,
                 mask_token_id: int | None = None, target_layer_ids=None) -> dict:
    """A z-lab DFlash config.json for a draft over `target_gguf` (hidden size and vocabulary from the target).

    The mask token defaults to the target's last token id (a row no tokenizer emits for the targets we know);
    the captured target layers default to ids spread evenly over the target's depth."""
    gf = target_gguf if isinstance(target_gguf, GGUFFile) else GGUFFile(target_gguf)
    arch = gf.architecture
    n_embd = int(gf.require(f"{arch}.embedding_length"))
    n_target = int(gf.require(f"{arch}.block_count"))
    n_vocab = int(gf.tensors["token_embd.weight"].ne[1])
    if target_layer_ids is None:
        target_layer_ids = sorted({int(round(x)) for x in np.linspace(1, max(1, n_target - 2), n_layer)})
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": n_embd,
        "num_hidden_layers": n_layer, "num_attention_heads": n_head, "num_key_value_heads": n_head_kv,
        "head_dim": head_dim, "intermediate_size": n_ff, "rms_norm_eps": rms_eps, "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": 262144, "vocab_size": n_vocab, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "block_size": block_size, "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": int(n_vocab - 1 if mask_token_id is None else mask_token_id),
                          "target_layer_ids": [int(i) for i in target_layer_ids]},
    }


# --- 1. data: the quantized target's own continuations and features ---------------------------------------------

def collect(target, tokenizer, prompts, out_dir: str, *, n_gen: int, progress: bool = True) -> list[str]:
    """Greedy continuations of `prompts` (token id lists) and the captured features of every position, one
    shard per sequence in out_dir (seq_00000.npz, ...). Shards that exist are kept, so a rerun resumes."""
    from tqdm import tqdm

    from .engine import Decoder

    os.makedirs(out_dir, exist_ok=True)
    if not target.capture_layers:
        raise ValueError("the target must capture the draft's target layers (load it with capture_layers)")
    ar = Decoder(target, None, mode="ar", tokenizer=tokenizer)
    paths = []
    for i, prompt in enumerate(tqdm(prompts, desc="target continuations", unit="seq", disable=not progress,
                                    file=sys.stderr)):
        path = os.path.join(out_dir, f"seq_{i:05d}.npz")
        paths.append(path)
        if os.path.exists(path):
            continue
        new, _ = ar.generate_ids(prompt, n_gen)
        seq = np.asarray(list(prompt) + new, np.int32)
        feats = np.empty((seq.size, len(target.capture_layers) * target.hp.n_embd), np.float16)

        def keep(first, n):
            feats[first: first + n] = target.captured_features().reshape(n, -1)

        target.reset()
        target.prefill(seq, return_logits=False, on_ubatch=keep)
        tmp = path + ".tmp.npz"
        np.savez(tmp, tokens=seq, features=feats, n_prompt=np.int32(len(prompt)))
        os.replace(tmp, path)
    return paths


def load_shards(paths) -> tuple[list[np.ndarray], list[np.ndarray]]:
    tokens, feats = [], []
    for p in paths:
        with np.load(p) as z:
            tokens.append(z["tokens"])
            feats.append(z["features"])
    return tokens, feats


# --- 2. training ---------------------------------------------------------------------------------------------

def target_matrix(gf: GGUFFile, name: str) -> np.ndarray:
    """A target weight as f32 [rows, n_embd] (dequantized with gguf-py), e.g. the embedding or the LM head."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    info = gf.tensors[name]
    rows, cols = info.ne[1], info.ne[0]
    raw = np.asarray(gf.data(info)).view(np.uint8).reshape(rows, -1)
    values = dequantize(raw, GGMLQuantizationType(int(info.type)))
    return np.array(values, dtype=np.float32).reshape(rows, cols)     # a writable copy, not a view of the map


class Trainer:
    """z-lab's DFlash draft model trained on collected shards; resumable from out_dir/checkpoint.pt."""

    def __init__(self, target_gguf, config: dict, out_dir: str, *, device: str = "cpu", lr: float = 2e-3,
                 batch: int = 16, seed: int = 0):
        import torch
        from dflash import model as zlab
        from transformers import Qwen3Config

        self.torch, self.device, self.batch, self.out_dir = torch, device, batch, out_dir
        self.config = config
        gf = GGUFFile(target_gguf)
        embed = target_matrix(gf, "token_embd.weight")
        head = target_matrix(gf, "output.weight") if "output.weight" in gf.tensors else embed
        self.embed = torch.from_numpy(embed).to(device)
        self.head = torch.from_numpy(head).to(device)
        torch.manual_seed(seed)
        self.model = zlab.DFlashDraftModel(Qwen3Config(**config)).float().to(device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.rng = np.random.default_rng(seed)
        self.step = 0
        self.losses: list[float] = []
        ckpt = os.path.join(out_dir, CHECKPOINT)
        if os.path.exists(ckpt):
            state = torch.load(ckpt, map_location=device, weights_only=False)
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])
            self.rng.bit_generator.state = state["rng"]
            self.step, self.losses = state["step"], state["losses"]

    def save_checkpoint(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        tmp = os.path.join(self.out_dir, CHECKPOINT + ".tmp")
        self.torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                         "rng": self.rng.bit_generator.state, "losses": self.losses}, tmp)
        os.replace(tmp, os.path.join(self.out_dir, CHECKPOINT))

    def batch_loss(self, tokens: list[np.ndarray], feats: list[np.ndarray]):
        """Cross-entropy of one batch: one anchor position a shared by the batch (the context length must be
        equal inside a batch), sequences drawn from those long enough to hold a whole block after it."""
        torch, block = self.torch, self.model.block_size
        lengths = np.array([t.size for t in tokens])
        a = int(self.rng.integers(2, int(lengths.max()) - block + 1))
        fit = np.flatnonzero(lengths >= a + block)
        rows = self.rng.choice(fit, size=self.batch, replace=fit.size < self.batch)
        seq = torch.from_numpy(np.stack([tokens[r][: a + block] for r in rows]).astype(np.int64)).to(self.device)
        ctx = torch.from_numpy(np.stack([feats[r][:a] for r in rows]).astype(np.float32)).to(self.device)
        block_in = torch.full((self.batch, block), int(self.model.mask_token_id), device=self.device)
        block_in[:, 0] = seq[:, a]
        noise = torch.nn.functional.embedding(block_in, self.embed)
        pos = torch.arange(0, a + block, device=self.device)[None].expand(self.batch, -1)
        hidden = self.model(position_ids=pos, noise_embedding=noise, target_hidden=ctx)
        logits = self.model.compute_logits(hidden[:, 1:, :], lambda h: h @ self.head.T)
        want = seq[:, a + 1: a + block]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), want.reshape(-1))

    def train(self, tokens, feats, steps: int, *, save_every: int = 200, progress: bool = True) -> list[float]:
        """Run up to `steps` optimizer steps in all (a resumed run continues its count); returns the losses."""
        from tqdm import tqdm

        if min(t.size for t in tokens) < self.model.block_size + 2:
            raise ValueError(f"training sequences need at least block_size + 2 = {self.model.block_size + 2} "
                             f"tokens")
        bar = tqdm(total=steps, initial=min(self.step, steps), desc="training draft", unit="step",
                   disable=not progress, file=sys.stderr)
        while self.step < steps:
            loss = self.batch_loss(tokens, feats)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.step += 1
            self.losses.append(float(loss.item()))
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(self.losses[-20:]):.3f}")
            if self.step % save_every == 0:
                self.save_checkpoint()
        bar.close()
        self.save_checkpoint()
        return self.losses


# --- 3. the draft on disk, and its acceptance --------------------------------------------------------------------

def save_draft(model, config: dict, draft_dir: str) -> None:
    """z-lab's format: config.json and model.safetensors (bf16)."""
    from .testing import bf16_bits, write_safetensors

    os.makedirs(draft_dir, exist_ok=True)
    with open(os.path.join(draft_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    specs = {}
    for name, value in model.state_dict().items():
        arr = value.detach().float().cpu().numpy()
        specs[name] = (np.uint16, arr.shape, lambda arr=arr: bf16_bits(arr))
    write_safetensors(os.path.join(draft_dir, "model.safetensors"), specs, {"format": "pt"})


def held_out_acceptance(target, draft_dir: str, prompts, *, n_gen: int, budget: int = 22,
                        mode: str = "ddtree") -> tuple[float, bool]:
    """Acceptance length of the draft in `draft_dir` over `prompts` (token ids), decoded by pydflash's engine,
    and whether every output equals AR's (it must on the CPU)."""
    from .engine import Decoder
    from .models.dflash_draft import DFlashDraft

    draft = DFlashDraft(draft_dir, target, top_k=min(budget, 8))
    spec = Decoder(target, draft, mode=mode, budget=budget)
    ar = Decoder(target, None, mode="ar")
    committed = steps = 0
    same = True
    for p in prompts:
        ref, _ = ar.generate_ids(p, n_gen)
        out, stats = spec.generate_ids(p, n_gen)
        committed += sum(stats["committed_per_step"])
        steps += stats["steps"]
        same &= out == ref
    return committed / max(steps, 1), same


def training_prompts(source: str, tokenizer, n: int, *, seed: int, n_vocab: int, max_tokens: int) -> list[list[int]]:
    """Token-id prompts for training: 'sharegpt' (first human turns, chat-templated), a .jsonl/.txt file of
    prompts (one JSON string or {"prompt": ...} per line, or one per line), or 'random' (random token ids: for
    synthetic targets, whose vocabulary carries no language)."""
    rng = np.random.default_rng(seed)
    if source == "random":
        return [[int(t) for t in rng.integers(3, n_vocab - 1, max_tokens)] for _ in range(n)]
    if tokenizer is None:
        raise ValueError(f"training data {source!r} needs the target's tokenizer")
    if source == "sharegpt":
        from .datasets import load_prompts
        texts = [(p.text, True) for p in load_prompts("sharegpt", n, seed=seed, max_chars=8 * max_tokens)]
    else:
        texts = []
        with open(source, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                if source.endswith(".jsonl"):
                    row = json.loads(line)
                    line = row if isinstance(row, str) else row.get("prompt") or row.get("text")
                    if not isinstance(line, str):
                        raise ValueError(f"{source}: each line needs a string or a 'prompt'/'text' field")
                texts.append((line, True))
        texts = texts[:n]
    prompts = []
    for text, chat in texts:
        if chat and tokenizer.chat_template:
            ids = tokenizer.chat_ids([{"role": "user", "content": text}])
        else:
            ids = tokenizer.tokenize(text, add_special=True)
        if 0 < len(ids) <= max_tokens:
            prompts.append(ids)
    if not prompts:
        raise ValueError(f"no training prompt of at most {max_tokens} tokens in {source!r}")
    return prompts


def train_draft(target_path, out_dir: str, *, data: str = "sharegpt", n_seq: int = 256, n_held_out: int = 8,
                n_gen: int = 128, max_prompt_tokens: int = 256, steps: int = 2000, device: str = "cpu",
                target_device: str = "auto", batch: int = 16, lr: float = 2e-3, seed: int = 0,
                draft_shape: dict | None = None, progress: bool = True) -> dict:
    """The whole recipe (collect, train, save, evaluate); resumable at every stage. Returns a summary."""
    from .models import load_target
    from .tokenizer import Tokenizer

    config_path = os.path.join(out_dir, "draft", "config.json")
    if os.path.exists(config_path):                 # resuming: keep the shape the run started with
        with open(config_path) as f:
            config = json.load(f)
    else:
        config = draft_config(target_path, **(draft_shape or {}))
    layers = config["dflash_config"]["target_layer_ids"]
    n_ctx = max_prompt_tokens + n_gen + 64
    target = load_target(target_path, target_device, n_ctx=n_ctx, n_ubatch=min(512, n_ctx), capture_layers=layers,
                         progress=progress)
    tokenizer = None if data == "random" else Tokenizer(target_path)
    prompts = training_prompts(data, tokenizer, n_seq + n_held_out, seed=seed, n_vocab=target.hp.n_vocab,
                               max_tokens=max_prompt_tokens)
    held_out, train_prompts = prompts[:n_held_out], prompts[n_held_out:]
    t0 = time.time()
    shards = collect(target, tokenizer, train_prompts, os.path.join(out_dir, "data"), n_gen=n_gen,
                     progress=progress)
    tokens, feats = load_shards(shards)
    t_collect = time.time() - t0
    trainer = Trainer(target_path, config, out_dir, device=device, lr=lr, batch=batch, seed=seed)
    losses = trainer.train(tokens, feats, steps, progress=progress)
    save_draft(trainer.model, config, os.path.join(out_dir, "draft"))
    al, same = held_out_acceptance(target, os.path.join(out_dir, "draft"), held_out, n_gen=n_gen)
    summary = {"target": os.path.basename(str(target_path)), "draft_dir": os.path.join(out_dir, "draft"),
               "config": {k: config[k] for k in ("num_hidden_layers", "num_attention_heads", "head_dim",
                                                 "intermediate_size", "block_size")},
               "target_layer_ids": layers, "data": data, "train_sequences": len(shards),
               "held_out_prompts": len(held_out), "steps": trainer.step, "seed": seed,
               "loss_first": float(np.mean(losses[:20])), "loss_last": float(np.mean(losses[-20:])),
               "held_out_acceptance_length": al, "outputs_equal_ar": same, "collect_s": t_collect}
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary
