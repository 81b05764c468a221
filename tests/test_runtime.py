"""The shared target runtime: one GGUF parse per load, one lookup of a draft's target layers, the capture."""
from __future__ import annotations

import json

import numpy as np
import pytest

import pydflash
from pydflash import gguf_io
from pydflash.models.dflash_draft import DFlashDraft
from pydflash.models.qwen35 import Qwen35Target
from pydflash.testing import write_dflash_draft, write_qwen35_gguf


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """An 8-layer tiny qwen35 (z-lab's default layer spread needs some depth) and a draft for it whose config
    has no target_layer_ids (only num_target_layers)."""
    root = tmp_path_factory.mktemp("runtime")
    target = root / "t.gguf"
    write_qwen35_gguf(target, n_layer=8, seed=3)
    draft = root / "draft"
    write_dflash_draft(draft, target, n_layer=2, target_layer_ids=[1, 5])
    cfg_path = draft / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["dflash_config"]["target_layer_ids"]
    assert cfg["num_target_layers"] == 8
    cfg_path.write_text(json.dumps(cfg))
    return str(target), str(draft)


def test_gguf_header_parsed_once_per_load(deep_model, monkeypatch):
    target, _ = deep_model
    parsed = []
    init = gguf_io.GGUFFile.__init__

    def counting_init(self, path):
        parsed.append(str(path))
        init(self, path)

    monkeypatch.setattr(gguf_io.GGUFFile, "__init__", counting_init)
    engine = pydflash.load(target, device="cpu", tokenizer=False)   # max_ctx from the header's context_length
    assert parsed == [target]
    assert engine.target.gguf.path == target and engine.target.n_ctx == 4096


def test_draft_without_target_layer_ids_loads_through_pydflash_load(deep_model):
    target, draft_dir = deep_model
    # z-lab's default for 2 draft layers over 8 target layers: round(1 + i * (8 - 4) / (2 - 1)) = 1, 5
    assert pydflash.api.draft_layer_ids(draft_dir) == [1, 5]
    spec = pydflash.load(target, draft_dir, mode="chain", budget=7, device="cpu", max_ctx=256, tokenizer=False)
    assert spec.target.capture_layers == (1, 5)
    assert spec.decoder.draft.draft.hp.target_layer_ids == (1, 5)
    prompt = [5, 17, 99, 3, 42, 8]
    ar = pydflash.load(target, device="cpu", max_ctx=256, tokenizer=False)
    assert spec.generate(prompt, max_tokens=12).tokens == ar.generate(prompt, max_tokens=12).tokens


def test_a_repeated_capture_layer_fills_every_column(deep_model):
    target, _ = deep_model
    prompt = [4, 9, 2, 200, 31]
    once = Qwen35Target(target, "cpu", n_ctx=64, capture_layers=(3,))
    once.prefill(prompt)
    twice = Qwen35Target(target, "cpu", n_ctx=64, capture_layers=(3, 6, 3))
    twice.prefill(prompt)
    feats = twice.captured_features()
    np.testing.assert_array_equal(feats[:, 0], once.captured_features()[:, 0])
    np.testing.assert_array_equal(feats[:, 2], feats[:, 0])
    assert not np.array_equal(feats[:, 1], feats[:, 0])


def test_draft_reads_the_public_capture_count(deep_model):
    target, draft_dir = deep_model
    t = Qwen35Target(target, "cpu", n_ctx=64, capture_layers=(1, 5))
    draft = DFlashDraft(draft_dir, t)
    t.prefill([1, 2, 3, 4, 5, 6, 7])
    assert t.n_captured == 7
    draft.append_from_target()
    assert draft.n_ctx == 7
    with pytest.raises(ValueError, match=r"0\.\.6"):
        draft.append_from_target([7])


def test_qwen35_attn_q_is_loaded_as_every_head_q_then_every_gate(deep_model, tmp_path):
    """attn_q's file rows interleave each head's Q and output gate (llama.cpp's layout); the target loads every
    head's Q rows first, then every gate's (Qwen35Target.row_orders), so the gate is a column slice of the
    product; an order that is not a permutation of the rows is refused by name."""
    path, _ = deep_model
    target = Qwen35Target(path, "cpu", n_ctx=64)
    hp, gf = target.hp, gguf_io.GGUFFile(path)
    il = hp.recurrent.index(False)
    name = f"blk.{il}.attn_q.weight"
    hd, n_head = hp.head_dim, hp.n_head
    file_rows = gf.data(gf.tensors[name]).reshape(2 * hd * n_head, -1)
    loaded = target.weights[name].numpy().reshape(2 * hd * n_head, -1).view(np.uint8)
    for h in range(n_head):
        assert np.array_equal(loaded[h * hd:(h + 1) * hd], file_rows[2 * h * hd:(2 * h + 1) * hd]), f"head {h}: Q"
        assert np.array_equal(loaded[(n_head + h) * hd:(n_head + h + 1) * hd],
                              file_rows[(2 * h + 1) * hd:(2 * h + 2) * hd]), f"head {h}: gate"
    info = gf.tensors[name]
    with pytest.raises(ValueError, match=name):
        gguf_io.upload(gf, [(info, target.weights[name])], row_orders={name: np.zeros(2 * hd * n_head, int)})
