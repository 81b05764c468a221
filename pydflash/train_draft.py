"""`pydflash train-draft`: train a DFlash draft for a GGUF target on the quantized target's own outputs.

A DFlash draft predicts the next block_size - 1 tokens from the target's hidden states (the outputs of a few
target layers) and the last committed token. z-lab trains drafts against BF16 Hugging Face targets; a draft that
runs beside a Q4_K_M GGUF then sees features it never saw in training. Here the data comes from pydflash's own
target graph on the very GGUF file the draft will serve:

1. Data: each sequence is the target's greedy continuation of a prompt, either given (`--continuations`, token
   ids generated beforehand, e.g. on the GPU: `prefill_continuations`) or generated here by AR decoding
   (`collect`); one prefill of prompt + continuation captures the draft's target layers at every position. Each
   sequence is saved as an .npz shard (tokens int32, features f16, prompt length), so this stage resumes.
2. `Trainer`: z-lab's PyTorch draft model (PyPI `dflash`; torch is an optional dependency: `pip install
   pydflash[train]`) learns, for anchor positions a in a sequence's output, to predict tokens a+1..a+B-1 from
   the features of positions 0..a-1 and the token at a. Many anchors of a sequence train in one forward
   (pydflash.draft_blocks), AdamW with warmup and cosine decay over a step or time budget, a position-weighted
   loss. The target's embedding and LM head are frozen (dequantized from the GGUF). Held-out sequences give a
   cheap teacher-forced metric during training (`Trainer.chain_acceptance`). Checkpoints (model, optimizer,
   step, time, sampler state) make it resumable.
3. `save_draft` writes z-lab's format (config.json + model.safetensors, bf16), which `pydflash.load` and z-lab's
   reference both read; `held_out_acceptance` decodes held-out prompts with pydflash's DDTree engine.
Inference never imports torch: only this module and draft_blocks do, and only inside the functions that train.
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

def read_continuations(path: str) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) token-id pairs from a .jsonl file of {"prompt": [ids...], "output": [ids...]} lines: the
    target's greedy output after its (chat-templated) prompt, written beforehand (e.g. on the GPU)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, output = row["prompt"], row["output"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: expected {{\"prompt\": [ids], \"output\": [ids]}} ({e})") from None
            if not (isinstance(prompt, list) and isinstance(output, list) and prompt
                    and all(isinstance(t, int) for t in prompt + output)):
                raise ValueError(f"{path}:{n}: 'prompt' (non-empty) and 'output' must be lists of token ids")
            rows.append((prompt, output))
    if not rows:
        raise ValueError(f"{path}: no continuation lines")
    return rows


def capture_features(target, seq: np.ndarray) -> np.ndarray:
    """One prefill of `seq` from an empty cache; the captured target layers of every position, f16
    [len(seq), n_capture * n_embd] (the draft's context features)."""
    feats = np.empty((seq.size, len(target.capture_layers) * target.hp.n_embd), np.float16)

    def keep(first, n):
        feats[first: first + n] = target.captured_features().reshape(n, -1)

    target.reset()
    target.prefill(seq, return_logits=False, on_ubatch=keep)
    return feats


def _save_shard(path: str, seq: np.ndarray, feats: np.ndarray, n_prompt: int) -> None:
    tmp = path + ".tmp.npz"
    np.savez(tmp, tokens=seq, features=feats, n_prompt=np.int32(n_prompt))
    os.replace(tmp, path)


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
        _save_shard(path, seq, capture_features(target, seq), len(prompt))
    return paths


def prefill_continuations(target, rows, out_dir: str, *, progress: bool = True) -> list[str]:
    """The features of given (prompt, output) sequences by one prefill each (no generation), one shard per
    sequence in out_dir as `collect` writes them; existing shards are kept."""
    from tqdm import tqdm

    os.makedirs(out_dir, exist_ok=True)
    if not target.capture_layers:
        raise ValueError("the target must capture the draft's target layers (load it with capture_layers)")
    paths = []
    bar = tqdm(total=sum(len(p) + len(o) for p, o in rows), desc="target features", unit="tok",
               unit_scale=True, disable=not progress, file=sys.stderr)
    for i, (prompt, output) in enumerate(rows):
        path = os.path.join(out_dir, f"seq_{i:05d}.npz")
        paths.append(path)
        if not os.path.exists(path):
            seq = np.asarray(list(prompt) + list(output), np.int32)
            _save_shard(path, seq, capture_features(target, seq), len(prompt))
        bar.update(len(prompt) + len(output))
    bar.close()
    return paths


def load_shards(paths) -> tuple[list[np.ndarray], list[np.ndarray], list[int]]:
    """tokens, features and prompt lengths of the shards at `paths`."""
    tokens, feats, n_prompt = [], [], []
    for p in paths:
        with np.load(p) as z:
            tokens.append(z["tokens"])
            feats.append(z["features"])
            n_prompt.append(int(z["n_prompt"]))
    return tokens, feats, n_prompt


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


class Sequences:
    """Training sequences packed on the training device: tokens and features of all sequences back to back."""

    def __init__(self, tokens, feats, n_prompt, device):
        import torch

        self.lengths = np.array([t.size for t in tokens], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.n_prompt = np.zeros(len(tokens), np.int64) if n_prompt is None else np.asarray(n_prompt, np.int64)
        self.tokens = torch.from_numpy(np.concatenate(tokens).astype(np.int64)).to(device)
        self.feats = torch.from_numpy(np.concatenate(feats).astype(np.float16)).to(device)

    def __len__(self) -> int:
        return self.lengths.size

    def first_anchor(self, rows) -> np.ndarray:
        """The first anchor position worth training: the first output token (anchors in the prompt would teach
        the draft the user's text), and at least 1 so that the block has context."""
        return np.maximum(1, self.n_prompt[rows])

    def gather(self, rows, positions: np.ndarray):
        """Flat indices of positions [len(rows), ...] (clamped into each row), and which positions are real."""
        lengths = self.lengths[rows].reshape((-1,) + (1,) * (positions.ndim - 1))
        inside = positions < lengths
        return np.minimum(positions, lengths - 1) + self.starts[rows].reshape(lengths.shape), inside


class Trainer:
    """z-lab's DFlash draft model trained on many blocks per sequence (pydflash.draft_blocks); resumable from
    out_dir/checkpoint.pt.

    Each step draws `batch` sequences and up to `anchors` anchor positions in each; every block's loss is the
    target-token cross-entropy at block positions 1..B-1, weighted exp(-(k-1)/loss_gamma) for position k (the
    DFlash recipe: early positions decide the accepted length; loss_gamma 0 weights all alike). The learning rate
    warms up linearly over `warmup` steps, then decays by a cosine to 5% over `schedule_steps` steps or
    `minutes` of training (whichever ends first; neither: constant)."""

    def __init__(self, target_gguf, config: dict, out_dir: str, *, device: str = "cpu", lr: float = 1e-3,
                 batch: int = 16, anchors: int = 32, warmup: int = 100, loss_gamma: float = 7.0,
                 grad_clip: float = 1.0, weight_decay: float = 0.01, schedule_steps: int | None = None,
                 minutes: float | None = None, seed: int = 0):
        import torch
        from dflash import model as zlab
        from transformers import Qwen3Config

        self.torch, self.device, self.batch, self.anchors, self.out_dir = torch, device, batch, anchors, out_dir
        self.config, self.peak_lr, self.grad_clip = config, lr, grad_clip
        self.schedule_steps, self.minutes = schedule_steps, minutes
        self.warmup = min(warmup, schedule_steps // 10) if schedule_steps else warmup
        self.cuda = str(device).startswith("cuda")
        gf = GGUFFile(target_gguf)
        embed = target_matrix(gf, "token_embd.weight")
        head = target_matrix(gf, "output.weight") if "output.weight" in gf.tensors else embed
        frozen = torch.bfloat16 if self.cuda else torch.float32        # bf16 halves the 151936-row head
        self.embed = torch.from_numpy(embed).to(device, frozen)
        self.head = torch.from_numpy(head).to(device, frozen)
        torch.manual_seed(seed)
        self.model = zlab.DFlashDraftModel(Qwen3Config(**config)).float().to(device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        k = torch.arange(self.model.block_size - 1, dtype=torch.float32, device=device)
        self.position_weight = torch.exp(-k / loss_gamma) if loss_gamma > 0 else torch.ones_like(k)
        self.rng = np.random.default_rng(seed)
        self.step, self.elapsed, self.trained_tokens = 0, 0.0, 0
        self.losses: list[float] = []
        self.evals: list[tuple[int, float]] = []        # (step, held-out chain acceptance)
        self.best: dict | None = None                   # the weights of the best evaluation
        ckpt = os.path.join(out_dir, CHECKPOINT)
        if os.path.exists(ckpt):
            state = torch.load(ckpt, map_location=device, weights_only=False)
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])
            self.rng.bit_generator.state = state["rng"]
            self.step, self.losses = state["step"], state["losses"]
            self.elapsed, self.evals, self.best = state["elapsed"], state["evals"], state["best"]
            self.trained_tokens = state["trained_tokens"]

    def save_checkpoint(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        tmp = os.path.join(self.out_dir, CHECKPOINT + ".tmp")
        self.torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                         "rng": self.rng.bit_generator.state, "losses": self.losses, "elapsed": self.elapsed,
                         "evals": self.evals, "best": self.best,
                         "trained_tokens": self.trained_tokens}, tmp)
        os.replace(tmp, os.path.join(self.out_dir, CHECKPOINT))

    def _autocast(self):
        import contextlib
        return self.torch.autocast("cuda", dtype=self.torch.bfloat16) if self.cuda else contextlib.nullcontext()

    def _progress(self) -> float:
        """How far the schedule has run, 0..1 (steps or minutes, whichever is further)."""
        done = 0.0
        if self.schedule_steps:
            done = self.step / self.schedule_steps
        if self.minutes:
            done = max(done, self.elapsed / (60 * self.minutes))
        return min(done, 1.0)

    def learning_rate(self) -> float:
        warm = min(1.0, (self.step + 1) / self.warmup) if self.warmup > 0 else 1.0
        if not (self.schedule_steps or self.minutes):
            return self.peak_lr * warm
        return self.peak_lr * warm * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * self._progress())))

    def sample(self, data: Sequences, eligible: np.ndarray):
        """Rows of one batch, their anchors [batch, anchors] and which anchors are real (a short row repeats
        its first anchor, weighted 0)."""
        rows = self.rng.choice(eligible, size=self.batch, replace=eligible.size < self.batch)
        first = data.first_anchor(rows)
        last = data.lengths[rows] - 2                    # the block must hold at least one target token
        anchors = np.zeros((self.batch, self.anchors), np.int64)
        real = np.zeros((self.batch, self.anchors), bool)
        for i in range(self.batch):
            span = int(last[i] - first[i] + 1)
            k = min(self.anchors, span)
            anchors[i, :k] = first[i] + self.rng.choice(span, size=k, replace=False)
            anchors[i, k:] = anchors[i, 0]
            real[i, :k] = True
        return rows, anchors, real

    def block_logits(self, data: Sequences, rows, anchors: np.ndarray):
        """The draft's logits [batch, m, B-1, n_vocab] of the blocks at `anchors` [batch, m] of `rows`, and the
        target's tokens there [batch, m, B-1] (-1 past a sequence's end)."""
        from .draft_blocks import blocks_hidden

        torch, block = self.torch, self.model.block_size
        n_ctx = int(anchors.max())
        ctx_index, _ = data.gather(rows, np.broadcast_to(np.arange(n_ctx), (len(rows), n_ctx)))
        feats = data.feats[torch.from_numpy(ctx_index).to(self.device)].float()
        tok_index, inside = data.gather(rows, anchors[:, :, None] + np.arange(block))
        toks = data.tokens[torch.from_numpy(tok_index).to(self.device)]
        ids = torch.full_like(toks, int(self.model.mask_token_id))
        ids[:, :, 0] = toks[:, :, 0]
        noise = torch.nn.functional.embedding(ids.reshape(len(rows), -1), self.embed).float()
        anchors_t = torch.from_numpy(anchors).to(self.device)
        with self._autocast():
            hidden = blocks_hidden(self.model, feats, anchors_t, noise)
            hidden = hidden.view(len(rows), anchors.shape[1], block, -1)[:, :, 1:]
            logits = self.model.compute_logits(hidden, lambda h: h @ self.head.T)
        want = torch.where(torch.from_numpy(inside[:, :, 1:]).to(self.device), toks[:, :, 1:], -1)
        return logits, want

    def batch_loss(self, data: Sequences, rows, anchors: np.ndarray, real: np.ndarray):
        """Position-weighted cross-entropy over the real blocks' target tokens; and how many tokens it covers."""
        torch = self.torch
        logits, want = self.block_logits(data, rows, anchors)
        want = torch.where(torch.from_numpy(real[:, :, None]).to(self.device), want, -1)
        ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 2), want.flatten().clamp(min=0),
                                               reduction="none").view(want.shape)
        weight = self.position_weight * (want >= 0)
        return (ce * weight).sum() / weight.sum(), int((want >= 0).sum())

    def chain_acceptance(self, data: Sequences, *, max_blocks: int = 128, chunk: int = 64) -> float:
        """Teacher-forced held-out metric: over anchors in each sequence's output (up to max_blocks, evenly
        spaced, whole blocks only), the mean of 1 + the number of leading block positions whose argmax is the
        target's token: the acceptance length of the draft's top-1 chain, computed without the engine."""
        torch, block = self.torch, self.model.block_size
        accepted = []
        self.model.eval()
        with torch.no_grad():
            for r in range(len(data)):
                first, last = int(data.first_anchor(np.array([r]))[0]), int(data.lengths[r]) - block
                if last < first:
                    continue
                anchors = np.unique(np.linspace(first, last, min(max_blocks, last - first + 1)).round().astype(np.int64))
                for c in range(0, anchors.size, chunk):
                    part = anchors[None, c: c + chunk]
                    logits, want = self.block_logits(data, np.array([r]), part)
                    hit = (logits.argmax(-1) == want).int().cumprod(-1).sum(-1)
                    accepted.extend(hit.flatten().tolist())
        self.model.train()
        if not accepted:
            raise ValueError("no held-out sequence holds a whole block after its prompt")
        return 1.0 + float(np.mean(accepted))

    def train(self, tokens, feats, steps: int | None = None, *, n_prompt=None, held: Sequences | None = None,
              eval_every: int = 250, save_every_s: float = 60.0, progress: bool = True) -> list[float]:
        """Train until `steps` optimizer steps in all (a resumed run continues its count) or the `minutes`
        budget is spent; returns the losses. held: sequences for the chain-acceptance metric, evaluated every
        `eval_every` steps and at the end; the best evaluation's weights are kept (`use_best`). A checkpoint is
        written every save_every_s seconds (it holds ~3x the draft's f32 weights: not every few steps)."""
        from tqdm import tqdm

        if steps is None and not self.minutes:
            raise ValueError("give steps or a minutes budget")
        data = tokens if isinstance(tokens, Sequences) else Sequences(tokens, feats, n_prompt, self.device)
        eligible = np.flatnonzero(data.lengths - 2 >= data.first_anchor(np.arange(len(data))))
        if eligible.size == 0:
            raise ValueError("no training sequence has an output of at least 2 tokens after its prompt")
        budget = 60 * self.minutes if self.minutes else None
        if budget:
            bar = tqdm(total=round(budget), initial=min(round(self.elapsed), round(budget)), desc="training draft",
                       unit="s", disable=not progress, file=sys.stderr)
        else:
            bar = tqdm(total=steps, initial=min(self.step, steps), desc="training draft", unit="step",
                       disable=not progress, file=sys.stderr)
        rate, saved = None, time.perf_counter()
        while (steps is None or self.step < steps) and (budget is None or self.elapsed < budget):
            t0 = time.perf_counter()
            for group in self.opt.param_groups:
                group["lr"] = self.learning_rate()
            loss, n_tok = self.batch_loss(data, *self.sample(data, eligible))
            self.opt.zero_grad()
            loss.backward()
            if self.grad_clip > 0:
                self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.opt.step()
            self.step += 1
            self.trained_tokens += n_tok
            self.losses.append(float(loss.item()))
            dt = time.perf_counter() - t0
            self.elapsed += dt
            rate = n_tok / dt if rate is None else 0.9 * rate + 0.1 * n_tok / dt
            bar.update(round(self.elapsed) - bar.n if budget else 1)
            bar.set_postfix(loss=f"{np.mean(self.losses[-20:]):.3f}", lr=f"{self.learning_rate():.1e}",
                            tok_s=f"{rate:.0f}")
            if held is not None and self.step % eval_every == 0:
                self.evaluate(held, bar if progress else None)
            if time.perf_counter() - saved > save_every_s:
                self.save_checkpoint()
                saved = time.perf_counter()
        if held is not None and (not self.evals or self.evals[-1][0] != self.step):
            self.evaluate(held, bar if progress else None)
        bar.close()
        self.save_checkpoint()
        return self.losses

    def evaluate(self, held: Sequences, bar=None) -> float:
        t0 = time.perf_counter()
        al = self.chain_acceptance(held)
        self.elapsed += time.perf_counter() - t0
        self.evals.append((self.step, al))
        if self.best is None or al > self.best["acceptance"]:
            self.best = {"step": self.step, "acceptance": al,
                         "state": {k: v.detach().clone() for k, v in self.model.state_dict().items()}}
        if bar is not None:
            bar.write(f"step {self.step}: loss {np.mean(self.losses[-50:]):.3f}, held-out chain acceptance "
                      f"{al:.3f} (best {self.best['acceptance']:.3f} at step {self.best['step']})", file=sys.stderr)
        return al

    def use_best(self) -> None:
        """Load the weights of the best held-out evaluation (if any) into the model."""
        if self.best is not None:
            self.model.load_state_dict(self.best["state"])


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


def read_prompt_file(path: str) -> list[dict]:
    """The prompts of a .jsonl or .txt file in file order, as {"prompt": text, "chat": bool, "source": id or None}.
    A .jsonl line is a JSON string or an object with "prompt" (or "text"), optionally "chat" (default true: wrap
    it in the chat template; false: code to complete, fed raw) and "source" (tools/prepare_gpu_carry.py writes
    such files); a .txt line is one chat prompt."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if not path.endswith(".jsonl"):
                rows.append({"prompt": line, "chat": True, "source": None})
                continue
            row = json.loads(line)
            row = {"prompt": row} if isinstance(row, str) else row
            text = row.get("prompt") or row.get("text") if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{n}: each line needs a string or a 'prompt'/'text' field")
            rows.append({"prompt": text, "chat": bool(row.get("chat", True)), "source": row.get("source")})
    return rows


def prompt_ids(tokenizer, text: str, chat: bool) -> list[int]:
    """A prompt's token ids: a user turn of the model's chat template where `chat` and the model has one, else the
    raw text (with the model's BOS)."""
    if chat and tokenizer.chat_template:
        return tokenizer.chat_ids([{"role": "user", "content": text}])
    return tokenizer.tokenize(text, add_special=True)


def training_prompts(source: str, tokenizer, n: int, *, seed: int, n_vocab: int, max_tokens: int) -> list[list[int]]:
    """Token-id prompts for training: 'sharegpt' (first human turns, chat-templated), a .jsonl/.txt file of
    prompts (`read_prompt_file`), or 'random' (random token ids: for synthetic targets, whose vocabulary carries
    no language)."""
    rng = np.random.default_rng(seed)
    if source == "random":
        return [[int(t) for t in rng.integers(3, n_vocab - 1, max_tokens)] for _ in range(n)]
    if tokenizer is None:
        raise ValueError(f"training data {source!r} needs the target's tokenizer")
    if source == "sharegpt":
        from .datasets import load_prompts
        texts = [(p.text, True) for p in load_prompts("sharegpt", n, seed=seed, max_chars=8 * max_tokens)]
    else:
        texts = [(row["prompt"], row["chat"]) for row in read_prompt_file(source)[:n]]
    prompts = [ids for ids in (prompt_ids(tokenizer, text, chat) for text, chat in texts)
               if 0 < len(ids) <= max_tokens]
    if not prompts:
        raise ValueError(f"no training prompt of at most {max_tokens} tokens in {source!r}")
    return prompts


def train_draft(target_path, out_dir: str, *, data: str = "sharegpt", continuations: str | None = None,
                n_seq: int | None = None, n_held_out: int = 8, n_gen: int = 128, max_prompt_tokens: int = 256,
                steps: int | None = None, minutes: float | None = None, device: str = "cpu",
                target_device: str = "auto", batch: int = 16, anchors: int = 32, lr: float = 1e-3,
                warmup: int = 100, loss_gamma: float = 7.0, grad_clip: float = 1.0, eval_every: int = 250,
                seed: int = 0, draft_shape: dict | None = None, progress: bool = True) -> dict:
    """The whole recipe (features, train, save, evaluate); resumable at every stage. Returns a summary.

    continuations: a .jsonl of the target's (prompt, output) token ids (`read_continuations`): each sequence is
    prefilled once for its features and nothing is generated; the last n_held_out lines are held out. Without
    it, prompts come from `data` (the first n_held_out held out) and the target generates n_gen tokens after
    each. n_seq: training sequences (default: every line of `continuations`; 256 prompts otherwise).
    steps / minutes: stop after that many optimizer steps or minutes of training, whichever comes first
    (neither: 2000 steps); the learning-rate schedule spans them. The saved draft is the one of the best
    held-out chain acceptance (`Trainer.chain_acceptance`, every eval_every steps and at the end)."""
    from .models import load_target
    from .tokenizer import Tokenizer

    if steps is None and minutes is None:
        steps = 2000
    config_path = os.path.join(out_dir, "draft", "config.json")
    if os.path.exists(config_path):                 # resuming: keep the shape the run started with
        with open(config_path) as f:
            config = json.load(f)
    else:
        config = draft_config(target_path, **(draft_shape or {}))
        os.makedirs(os.path.dirname(config_path), exist_ok=True)
        with open(config_path, "w") as f:
            json.dump(config, f, indent=1)
    layers = config["dflash_config"]["target_layer_ids"]
    rows = None
    if continuations is not None:
        rows = read_continuations(continuations)
        if len(rows) <= n_held_out:
            raise ValueError(f"{continuations}: {len(rows)} lines, but {n_held_out} are held out")
        n_ctx = max(max(len(p) + len(o) for p, o in rows), max(len(p) for p, _ in rows[-n_held_out:]) + n_gen)
        n_ctx += 64
    else:
        n_ctx = max_prompt_tokens + n_gen + 64
    target = load_target(target_path, target_device, n_ctx=n_ctx, n_ubatch=min(512, n_ctx), capture_layers=layers,
                         progress=progress)
    t0 = time.time()
    if rows is not None:
        held_rows, train_rows = rows[-n_held_out:], rows[:-n_held_out][:n_seq]
        held_out = [p for p, _ in held_rows]
        shards = prefill_continuations(target, train_rows, os.path.join(out_dir, "data"), progress=progress)
        held_shards = prefill_continuations(target, held_rows, os.path.join(out_dir, "held"), progress=progress)
    else:
        tokenizer = None if data == "random" else Tokenizer(target_path)
        prompts = training_prompts(data, tokenizer, (n_seq or 256) + n_held_out, seed=seed,
                                   n_vocab=target.hp.n_vocab, max_tokens=max_prompt_tokens)
        held_out, train_prompts = prompts[:n_held_out], prompts[n_held_out:]
        shards = collect(target, tokenizer, train_prompts, os.path.join(out_dir, "data"), n_gen=n_gen,
                         progress=progress)
        held_shards = collect(target, tokenizer, held_out, os.path.join(out_dir, "held"), n_gen=n_gen,
                              progress=progress)
    tokens, feats, n_prompt = load_shards(shards)
    t_collect = time.time() - t0
    trainer = Trainer(target_path, config, out_dir, device=device, lr=lr, batch=batch, anchors=anchors,
                      warmup=warmup, loss_gamma=loss_gamma, grad_clip=grad_clip, schedule_steps=steps,
                      minutes=minutes, seed=seed)
    held = Sequences(*load_shards(held_shards), device)
    losses = trainer.train(tokens, feats, steps, n_prompt=n_prompt, held=held, eval_every=eval_every,
                           progress=progress)
    final_chain = trainer.evals[-1][1]
    trainer.use_best()
    save_draft(trainer.model, config, os.path.join(out_dir, "draft"))
    al, same = held_out_acceptance(target, os.path.join(out_dir, "draft"), held_out, n_gen=n_gen)
    summary = {"target": os.path.basename(str(target_path)), "draft_dir": os.path.join(out_dir, "draft"),
               "config": {k: config[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                                 "head_dim", "intermediate_size", "block_size")},
               "target_layer_ids": layers, "data": continuations or data, "train_sequences": len(shards),
               "train_tokens": int(sum(t.size for t in tokens)), "held_out_prompts": len(held_out),
               "steps": trainer.step, "train_s": trainer.elapsed,
               "trained_tok_s": trainer.trained_tokens / max(trainer.elapsed, 1e-9), "batch": batch,
               "anchors": anchors, "lr": lr, "loss_gamma": loss_gamma, "seed": seed,
               "loss_first": float(np.mean(losses[:20])), "loss_last": float(np.mean(losses[-20:])),
               "held_out_chain_acceptance": trainer.best["acceptance"], "best_step": trainer.best["step"],
               "final_chain_acceptance": final_chain, "chain_acceptance_by_step": trainer.evals,
               "held_out_acceptance_length": al, "outputs_equal_ar": same, "collect_s": t_collect}
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary
