"""The memory plan (pydflash.plan): bytes per part for the 27B shape against sums done by hand, the auto-fit
rule at 24, 48 and 80 GiB, refusals that name the numbers, the plan against real allocations, and the CLI.

The 27B target is a header-only GGUF (testing.write_qwen35_gguf(data=False): a sparse file of the full size,
~6 MB on disk); the 27B draft is planned from its hyperparameters (z-lab's config numbers, docs/...: 5 layers,
32 Q / 8 KV heads of 128, FFN 17408, block 16, 5 captured layers), since its bf16 file would be 3.5 GB.
"""
from __future__ import annotations

import os

import pytest

from pydflash import plan
from pydflash.api import load
from pydflash.cli import main
from pydflash.gguf_io import GGUFFile
from pydflash.models.dflash_draft import DFlashHParams
from pydflash.testing import preset_27b, write_dflash_draft, write_dflash_gguf, write_llama_gguf, write_qwen35_gguf

GiB = 1 << 30
DRAFT_27B = DFlashHParams(n_layer=5, n_embd=5120, n_ff=17408, n_head=32, n_head_kv=8, head_dim=128, rms_eps=1e-6,
                          rope_theta=1e7, block_size=16, mask_token_id=248070, target_layer_ids=(1, 16, 31, 46, 61),
                          causal=(False,) * 5, window=(0,) * 5)


@pytest.fixture(scope="module")
def target_27b(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "qwen35-27b-header.gguf"
    write_qwen35_gguf(path, preset_27b(), data=False)
    return path


@pytest.fixture(scope="module")
def shape_27b(target_27b):
    return plan.target_shape(target_27b)


def ddtree_args():
    return dict(draft=plan.DraftShape.from_hparams(DRAFT_27B), n_slots=23, n_ubatch=512)


@pytest.mark.slow
def test_27b_parts_match_sums_by_hand(target_27b, shape_27b):
    hp, weights = shape_27b
    # weights: the file's data section, less at most 32 bytes of alignment padding per tensor
    gf = GGUFFile(target_27b)
    data = os.path.getsize(target_27b) - min(t.offset for t in gf.tensors.values())
    assert 0 <= data - weights < 32 * len(gf.tensors)
    assert 15.5 * GiB < weights < 16.5 * GiB           # a Q4_K_M 27B

    p = plan.memory_plan(hp, weights, 262144, "tq3_0", **ddtree_args())
    attn_layers, kv_row, n_rec = 16, 4 * 256, 48          # layers 3, 7, .., 63 attend; 4 KV heads of 256
    tq3_row = kv_row // 32 * 14                           # 14-byte blocks of 32 values
    state = 128 * 128 * 48 * 4                            # S_v x S_v x v heads, f32
    conv = 3 * (2 * 16 * 128 + 48 * 128) * 4              # (d_conv - 1) x conv_dim, f32
    # q, k, v, o and the MLP in bf16; q/k norms and the two layer norms in f32
    per_draft_layer = (5120 * 4096 + 2 * 5120 * 1024 + 4096 * 5120 + 3 * 5120 * 17408) * 2 + (2 * 128 + 2 * 5120) * 4
    draft_weights = 5 * per_draft_layer + 5 * 5120 * 5120 * 2 + 2 * 5120 * 4
    want = {
        "target weights": weights,
        "KV cache (tq3_0, 262144 cells)": attn_layers * 2 * 262144 * tq3_row,
        "recurrent states": n_rec * (conv + state),
        "verify stores (23 slots, f32)": n_rec * 23 * (state + (2 * 16 * 128 + 48 * 128) * 4),
        "captured features": 5120 * 5 * 512 * 4,
        "draft weights": draft_weights,
        "draft context ring": 5 * 2 * (8 * 128) * 2 * 2304,     # block 16 + window 2048 -> 2304 rows
        "reserve": 512 << 20,
    }
    for name, n in want.items():
        assert p.parts[name] == n, name
    assert p.parts["KV cache (tq3_0, 262144 cells)"] * 8 == attn_layers * 2 * 262144 * kv_row * 3.5
    # the compute estimate, by its documented formula: mask, one layer's activations, logits of 23 slots, the
    # f16 staging of one layer's quantized K and V, the draft's logits + softmax and its append activations
    compute = (512 * 262144 * 2 + 512 * 4 * (3 * 17408 + 4 * 5120 + 10240 + 6144) + 248320 * 4 * 23
               + 2 * 262144 * kv_row * 2 + 2 * 248320 * 15 * 4 + 512 * 4 * (5120 * 7 + 3 * 17408))
    assert p.parts["compute (estimate)"] == compute
    assert p.total == sum(want.values()) + compute
    # the other KV types, per cell: f16 2 bytes a value, q8_0 34 bytes / 32, q4_0 18 bytes / 32
    for kv, row in (("f16", kv_row * 2), ("q8_0", kv_row // 32 * 34), ("q4_0", kv_row // 32 * 18)):
        assert plan.kv_bytes(hp, 100_000, kv) == attn_layers * 2 * 100_096 * row   # cells: a multiple of 256


@pytest.mark.slow
@pytest.mark.parametrize("gib,mode,kv,ctx", [
    (80, "ddtree", "f16", 262144), (48, "ddtree", "f16", 262144), (24, "ddtree", "tq3_0", None),
    (80, "ar", "f16", 262144), (48, "ar", "f16", 262144), (24, "ar", "q4_0", 262144)])
def test_auto_fit(shape_27b, gib, mode, kv, ctx):
    """The documented rule (README): the training context (262144) in the first of f16, q8_0, q4_0, tq3_0 that
    holds it, else tq3_0 at the longest context that fits. 24 GiB with the bf16 draft and f32 verify states
    leaves room for tens of thousands of positions only."""
    hp, weights = shape_27b
    args = ddtree_args() if mode == "ddtree" else {}
    vram = gib * GiB
    p = plan.fit(hp, weights, vram, **args)
    assert p.kv_type == kv and p.total <= vram
    if ctx is not None:
        assert p.n_ctx == ctx
    else:
        assert 16384 <= p.n_ctx < 65536 and p.n_ctx % 256 == 0
        # the longest: one more bucket does not fit
        assert plan.memory_plan(hp, weights, p.n_ctx + 256, kv, **args).total > vram
    # every type before the chosen one misses at the training context
    order = plan.AUTO_KV_ORDER
    for better in order[:order.index(kv)]:
        assert plan.memory_plan(hp, weights, 262144, better, **args).total > vram


@pytest.mark.slow
def test_impossible_requests_name_the_numbers(shape_27b):
    hp, weights = shape_27b
    with pytest.raises(plan.PlanError, match=r"max_ctx 262144 does not fit in 24.00 GiB: with kv_type tq3_0 it "
                                             r"needs 28.1\d GiB \(target weights 15.79 GiB"):
        plan.fit(hp, weights, 24 * GiB, max_ctx=262144, **ddtree_args())
    with pytest.raises(plan.PlanError, match=r"nothing fits in 15.00 GiB: 256 positions with kv_type tq3_0 need"):
        plan.fit(hp, weights, 15 * GiB)
    with pytest.raises(plan.PlanError, match=r"max_ctx 8192 does not fit in 20.00 GiB: with kv_type f16 it needs "
                                             r"23.9\d GiB .* not even 256 positions fit with kv_type f16"):
        plan.fit(hp, weights, 20 * GiB, max_ctx=8192, kv_type="f16", **ddtree_args())
    with pytest.raises(plan.PlanError, match=r"max_ctx 65536 does not fit in 24.00 GiB: with kv_type f16 .* at most "
                                             r"\d+ positions fit with kv_type f16"):
        plan.fit(hp, weights, 24 * GiB, max_ctx=65536, kv_type="f16", **ddtree_args())


def test_parse_size():
    assert plan.parse_size("24GiB") == 24 * GiB
    assert plan.parse_size("24G") == 24 * GiB
    assert plan.parse_size("24GB") == 24 * 10 ** 9
    assert plan.parse_size("1.5 MiB") == 3 << 19
    assert plan.parse_size(1000) == 1000
    with pytest.raises(ValueError, match="'24 gigs'"):
        plan.parse_size("24 gigs")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan_tiny")
    write_qwen35_gguf(d / "t.gguf", seed=3)
    write_dflash_draft(d / "draft", d / "t.gguf", seed=3)
    return d / "t.gguf", d / "draft"


@pytest.mark.parametrize("state_type", ["f32", "replay"])
def test_plan_matches_real_allocations(tiny_pair, state_type):
    """Loaded on the CPU, the buffers of every planned part hold the planned bytes (buffers are padded to their
    alignment, at most 64 bytes a tensor)."""
    target_path, draft_path = tiny_pair
    engine = load(target_path, draft_path, device="cpu", max_ctx=1000, kv_type="q8_0", budget=10, tokenizer=False,
                  state_type=state_type)
    t, d = engine.target, engine.decoder.draft.draft
    p = engine.target.memory_plan
    assert (p.n_ctx, p.kv_type) == (1000, "q8_0")

    def close(actual, planned, n_tensors):
        assert planned <= actual <= planned + 64 * n_tensors, (actual, planned)

    rot = t.cache.k_rot.nbytes + t.cache.v_rot.nbytes             # q8_0's rotation matrices live in the cache
    close(t.cache.buffer.nbytes - rot, p.parts["KV cache (q8_0, 1024 cells)"] + p.parts["recurrent states"],
          len(t.cache.k) * 2 + len(t.cache.ssm) * 2 + 2)
    close(t.weights.buffer.nbytes, p.parts["target weights"], len(t.weights.t))
    close(t._verify_buffer.nbytes, p.parts[f"verify stores (11 slots, {state_type})"], 2 * len(t.slot_states))
    close(t._capture_buffer.nbytes, p.parts["captured features"], 1)
    close(d.weights.buffer.nbytes, p.parts["draft weights"], len(d.weights.t))
    close(d.cache.buffer.nbytes, p.parts["draft context ring"], 2 * d.hp.n_layer)


def test_prefix_snapshots_planned_as_allocated(tiny_pair):
    """load counts the prefix cache's snapshots (as many as its byte bound allows), each the size of a real one."""
    target_path, _ = tiny_pair
    engine = load(target_path, device="cpu", max_ctx=512, tokenizer=False, prefix_snapshots=3)
    t, prefix = engine.target, engine.decoder.prefix
    per = sum(x.nbytes for x in t.cache.conv.values()) + sum(x.nbytes for x in t.cache.ssm.values())
    assert prefix.capacity == 3 and prefix.snapshot_nbytes == per
    assert t.memory_plan.parts["prefix snapshots"] == 3 * per
    bounded = load(target_path, device="cpu", max_ctx=512, tokenizer=False, prefix_snapshots=3,
                   prefix_bytes=2 * per + 1)
    assert bounded.decoder.prefix.capacity == 2 and bounded.target.memory_plan.parts["prefix snapshots"] == 2 * per
    off = load(target_path, device="cpu", max_ctx=512, tokenizer=False, prefix_cache=False)
    assert off.target.memory_plan.parts["prefix snapshots"] == 0 and off.decoder.prefix is None


def test_prefix_snapshots_yield_to_the_context(tiny_pair):
    """Snapshots are planned after the context: in memory that holds the context and two of them, two are
    kept; in memory that holds only the context, none (prefix reuse off) rather than a refusal."""
    target_path, _ = tiny_pair
    bare = plan.plan_for_files(target_path, max_ctx=512, kv_type="f16")      # no snapshots, 512-token batches
    per = plan.recurrent_state_bytes(plan.target_shape(target_path)[0])
    for vram, n in ((bare.total + 2 * per + per // 2, 2), (bare.total + per // 2, 0)):
        engine = load(target_path, device="cpu", max_ctx=512, kv_type="f16", n_ubatch=512, vram=vram,
                      tokenizer=False)
        p = engine.target.memory_plan
        assert (p.prefix_snapshots, p.parts["prefix snapshots"], p.n_ctx) == (n, n * per, 512)
        assert p.total <= vram
        assert (0 if engine.decoder.prefix is None else engine.decoder.prefix.capacity) == n


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_attention_only_architectures(arch, tmp_path, capsys):
    """An attention-only target (no recurrent state) is planned from its own header: KV and weights as
    allocated, no recurrent parts; load's auto defaults fit it to the training context."""
    path = tmp_path / f"{arch}.gguf"
    cfg = write_llama_gguf(path, arch=arch, seed=4)
    engine = load(path, device="cpu", tokenizer=False, verbose=True)      # max_ctx, kv_type, n_ubatch auto
    t, p = engine.target, engine.target.memory_plan
    assert (t.n_ctx, p.kv_type, t.n_ubatch) == (cfg.n_ctx_train, "f16", 2048)
    assert f"memory plan: n_ctx {cfg.n_ctx_train}, kv_type f16" in capsys.readouterr().err
    head_dim = cfg.head_dim or cfg.n_embd // cfg.n_head
    kv = cfg.n_layer * 2 * cfg.n_ctx_train * head_dim * cfg.n_head_kv * 2        # f16 K and V of every layer
    assert p.parts[f"KV cache (f16, {cfg.n_ctx_train} cells)"] == kv
    assert p.parts["recurrent states"] == p.parts["prefix snapshots"] == 0
    assert p.parts["verify stores (0 slots, f32)"] == 0
    assert kv <= t.cache.buffer.nbytes <= kv + 64 * 2 * cfg.n_layer
    assert p.parts["target weights"] <= t.weights.buffer.nbytes <= p.parts["target weights"] + 64 * len(t.weights.t)
    with pytest.raises(plan.PlanError, match=f"max_ctx {cfg.n_ctx_train} does not fit in 1.0 MiB"):
        load(path, device="cpu", tokenizer=False, max_ctx=cfg.n_ctx_train, vram="1MiB")


def test_draft_gguf_planned_like_its_folder(tiny_pair, tmp_path):
    _, draft_path = tiny_pair
    write_dflash_gguf(tmp_path / "d.gguf", draft_path)
    assert plan.DraftShape.from_path(tmp_path / "d.gguf") == plan.DraftShape.from_path(draft_path)


def test_load_prints_and_refuses(tiny_pair, capsys):
    target_path, _ = tiny_pair
    engine = load(target_path, device="cpu", tokenizer=False, verbose=True)    # max_ctx and kv_type auto
    assert (engine.target.n_ctx, engine.target.cache.kv_type.name) == (4096, "F16")   # the training context
    err = capsys.readouterr().err
    assert "memory plan: n_ctx 4096, kv_type f16" in err and "KV cache (f16, 4096 cells)" in err
    with pytest.raises(plan.PlanError, match="max_ctx 4096 does not fit in 1.0 MiB"):
        load(target_path, device="cpu", tokenizer=False, max_ctx=4096, vram="1MiB")


def test_cli_plan(tiny_pair, capsys):
    target_path, draft_path = tiny_pair
    assert main(["plan", "--target", str(target_path), "--draft", str(draft_path), "--vram", "4GiB",
                 "--max-ctx", "2048", "--kv", "tq3_0"]) == 1          # tiny heads (64) cannot use tq3_0
    assert "multiple of 128" in capsys.readouterr().err
    assert main(["plan", "--target", str(target_path), "--draft", str(draft_path), "--vram", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "memory plan: n_ctx 4096, kv_type f16" in out and "draft weights" in out and "verify stores (23 slots" in out
    assert main(["plan", "--target", str(target_path), "--vram", "1MiB", "--max-ctx", "4096"]) == 1
    assert "does not fit in 1.0 MiB" in capsys.readouterr().err
    assert main(["plan", "--target", str(target_path), "--vram", "lots"]) == 1
    assert "size 'lots'" in capsys.readouterr().err
