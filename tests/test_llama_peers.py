"""llama.cpp peers in `pydflash bench` (pydflash/llama_peers.py), the report columns they add, and the training
prompt sets of tools/gpu_real17.sh.

The end-to-end test needs llama.cpp's llama-simple and llama-speculative-simple built on our ggml by
tools/build_llama_bench.sh (about 10 minutes on 2 cores, more than this suite's budget allows in CI): it runs
when PYDFLASH_LLAMA_BIN names the folder that script printed, and is skipped otherwise.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pydflash import benchmark, datasets, llama_peers, testing
from pydflash.benchmark import PromptRun
from pydflash.gguf_io import GGUFFile


def _run(dataset, i, *, ar=None, spec=None, equal=True):
    """A PromptRun with round pydflash numbers and, when given, llama.cpp's (tokens, seconds[, drafted, accepted])."""
    r = PromptRun(dataset=dataset, id=f"{dataset}/{i}", chat=True, prompt_tokens=10, ar_tokens=11, spec_tokens=11,
                  ar_decode_s=1.0, ar_prefill_s=0.5, spec_decode_s=0.5, spec_steps=5, spec_committed=10,
                  identical=True, histogram=[0, 0, 5])
    if ar:
        r.llama_ar_decoded, r.llama_ar_s, r.llama_ar_equal = ar[0], ar[1], equal
    if spec:
        r.llama_spec_decoded, r.llama_spec_s, r.llama_drafted, r.llama_accepted = spec
    return r


def test_peer_columns_are_totals_over_totals():
    runs = [_run("gsm8k", 0, ar=(30, 1.0), spec=(40, 0.5, 20, 15)),
            _run("gsm8k", 1, ar=(10, 1.0), spec=(20, 0.5, 20, 5), equal=False)]
    s = benchmark.summarize(runs)
    assert s["llama_ar_tok_s"] == pytest.approx(20.0)          # 40 tokens in 2 s, not the mean of 30 and 10
    assert s["llama_spec_tok_s"] == pytest.approx(60.0)        # 60 tokens in 1 s
    assert s["llama_accept_rate"] == pytest.approx(0.5)        # 20 of 40 drafted
    assert s["llama_ar_equal_outputs"] == 1
    table = benchmark.markdown({"gsm8k": s}, {"target": "t.gguf", "draft": "d", "mode": "ddtree", "budget": 22,
                                              "device": "cpu", "n_gen": 10, "seed": 0, "prompt_format": "auto"})
    head, _, row = table.strip().splitlines()[-3:]
    assert "llama.cpp AR tok/s | llama.cpp speculative tok/s | llama.cpp acceptance rate" in head
    assert row.endswith("| 20.0 | 60.0 | 50.0% | 1/2 |")


def test_no_peer_columns_without_peers():
    s = benchmark.summarize([_run("math500", 0)])
    assert not any(k.startswith("llama") for k in s)
    table = benchmark.markdown({"math500": s}, {"target": "t", "draft": "d", "mode": "ddtree", "budget": 22,
                                                "device": "cpu", "n_gen": 10, "seed": 0, "prompt_format": "auto"})
    assert "llama.cpp" not in table


def test_merged_reports_hold_every_dataset(tmp_path):
    settings = {"target": "t", "draft": "d", "mode": "ddtree", "budget": 22, "device": "cpu", "n_gen": 10,
                "seed": 0, "prompt_format": "auto"}
    for name, runs in (("humaneval", [_run("humaneval", 0, ar=(30, 1.0))]),
                       ("gsm8k", [_run("gsm8k", 0, ar=(10, 1.0)), _run("gsm8k", 1, ar=(10, 0.25))])):
        benchmark.write_report(str(tmp_path / name), runs, {name: benchmark.summarize(runs)}, settings)
    benchmark.merge_reports([str(tmp_path / "humaneval"), str(tmp_path / "gsm8k")], str(tmp_path / "all"))
    record = json.load(open(tmp_path / "all" / "bench.json"))
    assert list(record["datasets"]) == ["humaneval", "gsm8k"] and len(record["prompts"]) == 3
    assert record["datasets"]["gsm8k"]["llama_ar_tok_s"] == pytest.approx(20 / 1.25)
    assert record["datasets"]["humaneval"]["llama_ar_tok_s"] == pytest.approx(30.0)


def test_missing_programs_are_named(tmp_path):
    target = str(tmp_path / "t.gguf")
    testing.write_qwen35_gguf(target, seed=1)
    with pytest.raises(llama_peers.PeerError, match="llama-simple.*build_llama_bench.sh"):
        llama_peers.LlamaPeers(str(tmp_path), target)
    (tmp_path / "llama-simple").write_text("#!/bin/sh\n")
    os.chmod(tmp_path / "llama-simple", 0o755)
    llama_peers.LlamaPeers(str(tmp_path), target)                  # AR alone needs only llama-simple
    with pytest.raises(llama_peers.PeerError, match="llama-speculative-simple"):
        llama_peers.LlamaPeers(str(tmp_path), target, target)
    with pytest.raises(llama_peers.PeerError, match="not a folder"):
        llama_peers.LlamaPeers(str(tmp_path / "nowhere"), target)


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    target, other = str(tmp_path / "t.gguf"), str(tmp_path / "o.gguf")
    testing.write_qwen35_gguf(target, seed=1)
    n_tokens = len(GGUFFile(target).get("tokenizer.ggml.tokens"))
    testing.write_qwen35_gguf(other, seed=1, n_vocab=n_tokens + 200)
    llama_peers.check_same_vocabulary(target, target)
    with pytest.raises(llama_peers.PeerError, match=r"o\.gguf.*tokens.*t\.gguf.*tokenizer"):
        llama_peers.check_same_vocabulary(target, other)


def test_bench_command_refuses_bad_peers_before_loading(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pydflash.cli", "bench", "--demo", "--device", "cpu",
                          "--llama-bin", str(tmp_path), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "llama-simple" in out.stderr and "build_llama_bench.sh" in out.stderr
    assert not (tmp_path / "o").exists()


def test_json_array_records_keep_what_precedes_a_cut():
    text = json.dumps([{"id": 1}, {"id": 2, "x": [1, 2]}, {"id": 3, "s": "abc"}])
    assert datasets._json_array_records(text) == [{"id": 1}, {"id": 2, "x": [1, 2]}, {"id": 3, "s": "abc"}]
    cut = text[: text.index('"abc"') + 3]
    assert datasets._json_array_records(cut) == [{"id": 1}, {"id": 2, "x": [1, 2]}]


def test_training_sets_share_no_question_with_the_benchmarks():
    for train, test in (("gsm8k-train", "gsm8k"), ("math-train", "math500")):
        seen = {p.text for p in datasets.load_prompts(test)}
        train_prompts = datasets.load_prompts(train)
        assert len(train_prompts) > 7000 and all(p.chat for p in train_prompts)
        assert not seen & {p.text for p in train_prompts}


@pytest.fixture(scope="module")
def peer_bin():
    path = os.environ.get("PYDFLASH_LLAMA_BIN")
    if not path:
        pytest.skip("PYDFLASH_LLAMA_BIN is not set: build llama.cpp's peers with tools/build_llama_bench.sh "
                    "(~10 min on 2 cores, beyond CI's budget) and point it at the folder it prints")
    return path


@pytest.mark.slow
def test_bench_with_llama_cpp_peers_end_to_end(peer_bin, tmp_path):
    """SmolLM2 as target and as llama.cpp's draft, a random DFlash draft for pydflash: every llama.cpp column is
    filled, llama.cpp's greedy AR text equals pydflash's AR text on every prompt (the oracle), and a draft model
    identical to the target has its drafts accepted."""
    from pydflash.real_models import fetch

    smol = str(fetch("smollm2-135m"))
    draft = tmp_path / "draft"
    testing.write_dflash_draft(str(draft), smol, n_layer=1, n_head=4, n_head_kv=2, head_dim=64, n_ff=256, seed=0)
    out = subprocess.run([sys.executable, "-m", "pydflash.cli", "bench", "--target", smol, "--draft", str(draft),
                          "--device", "cpu", "--n-prompts", "2", "--n-gen", "12", "--budget", "8", "--max-ctx", "1024",
                          "--llama-bin", peer_bin, "--llama-draft", smol, "--llama-draft-max", "8",
                          "--out", str(tmp_path / "report")], capture_output=True, text=True, timeout=2400)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.load(open(tmp_path / "report" / "bench.json"))
    assert record["settings"]["llama"]["draft"] == os.path.basename(smol)
    prompts = record["prompts"]
    assert len(prompts) == 6 and {p["dataset"] for p in prompts} == set(datasets.BENCHMARKS)
    for p in prompts:
        assert p["llama_ar_equal"], p["id"]
        assert p["llama_ar_tok_s"] > 0 and p["llama_spec_tok_s"] > 0
        assert p["llama_ar_decoded"] == p["ar_tokens"] - 1 or p["ar_tokens"] < 12      # 11 one-token evals
        assert p["llama_drafted"] > 0
    for name, s in record["datasets"].items():
        assert s["llama_ar_equal_outputs"] == 2
        assert s["llama_accept_rate"] > 0.8, name         # the draft model is the target itself
    table = open(tmp_path / "report" / "bench.md").read()
    assert "llama.cpp AR tok/s" in table and "llama.cpp speculative tok/s" in table
