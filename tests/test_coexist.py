"""pydflash's ggml and llama-cpp-python's ggml live in one process without binding to each other's copies."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

# Runs in a fresh interpreter: the order of loading matters (llama_cpp first, so its libggml*.so are already
# mapped when pydflash loads; a shared SONAME would then be satisfied by the wrong file).
SCRIPT = textwrap.dedent(
    r"""
    import json, sys
    import numpy as np
    import gguf

    path = sys.argv[1]
    # a one-layer llama model with a byte-level BPE vocabulary: enough for llama.cpp to load and evaluate
    w = gguf.GGUFWriter(path, "llama")
    E, F = 32, 64
    w.add_context_length(64); w.add_embedding_length(E); w.add_block_count(1); w.add_feed_forward_length(F)
    w.add_head_count(2); w.add_head_count_kv(2); w.add_layer_norm_rms_eps(1e-6); w.add_rope_dimension_count(16)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("default")
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    tokens = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))] + ["he"]
    w.add_token_list(tokens); w.add_token_types([1] * len(tokens)); w.add_token_merges(["h e"])
    w.add_bos_token_id(0); w.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    def rand(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)
    V = len(tokens)
    w.add_tensor("token_embd.weight", rand(V, E)); w.add_tensor("output.weight", rand(V, E))
    w.add_tensor("output_norm.weight", np.ones(E, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(E, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(E, np.float32))
    for name in ["attn_q", "attn_k", "attn_v", "attn_output"]:
        w.add_tensor(f"blk.0.{name}.weight", rand(E, E))
    w.add_tensor("blk.0.ffn_gate.weight", rand(F, E)); w.add_tensor("blk.0.ffn_up.weight", rand(F, E))
    w.add_tensor("blk.0.ffn_down.weight", rand(E, F))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    import llama_cpp
    llm = llama_cpp.Llama(path, n_ctx=32, n_threads=2, logits_all=True, verbose=False)
    tokens = llm.tokenize(b"hello there", add_bos=False)
    llm.eval(tokens)
    llama_logits = np.asarray(llm.scores[len(tokens) - 1])

    from pydflash import ggml
    be = ggml.Backend("cpu", n_threads=2)
    ctx = ggml.Context(n_tensors=8, graph_size=8)
    a = ctx.new_tensor(np.float32, (4, 3)).mark_input()
    b = ctx.new_tensor(np.float32, (4, 2)).mark_input()
    graph = ctx.graph(ctx.mul_mat(a, b))
    ggml.Allocator(be).allocate(graph)
    a.set(np.arange(12, dtype=np.float32).reshape(3, 4))
    b.set(np.ones((2, 4), dtype=np.float32))
    be.compute(graph)
    product = graph.outputs[0].numpy()

    # llama.cpp still works after pydflash ran
    llm.reset(); llm.eval(tokens)
    again = np.asarray(llm.scores[len(tokens) - 1])

    maps = [line.split()[-1] for line in open("/proc/self/maps") if ".so" in line]
    print(json.dumps({"maps": sorted(set(maps)), "product": product.tolist(),
                      "llama_finite": bool(np.isfinite(llama_logits).all()),
                      "llama_nonzero": bool(np.abs(llama_logits).max() > 0),
                      "llama_repeatable": bool(np.array_equal(llama_logits, again)),
                      "pydflash_dir": str(ggml.core.__file__), "llama_dir": llama_cpp.__file__}))
    """
)


def test_pydflash_and_llama_cpp_use_their_own_ggml(tmp_path: Path):
    import json

    # cwd outside the checkout: `python -c` puts cwd on sys.path, and the source tree has no built libraries
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "tiny.gguf")], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])

    assert result["product"] == [[6.0, 22.0, 38.0], [6.0, 22.0, 38.0]]
    assert result["llama_finite"] and result["llama_nonzero"] and result["llama_repeatable"]

    ggml_libs = [p for p in result["maps"] if "ggml" in Path(p).name]
    ours = [p for p in ggml_libs if Path(p).name.startswith("libpydflash-ggml")]
    theirs = [p for p in ggml_libs if not Path(p).name.startswith("libpydflash-ggml")]
    pkg_lib = Path(result["pydflash_dir"]).resolve().parents[1] / "lib"
    # ours: base, cpu and the registry library, all from pydflash/lib
    assert {Path(p).name for p in ours} >= {"libpydflash-ggml.so", "libpydflash-ggml-base.so",
                                             "libpydflash-ggml-cpu.so"}, ggml_libs
    assert all(Path(p).parent == pkg_lib for p in ours), ours
    # theirs: llama-cpp-python's own libggml*, none of them from our folder
    assert any(Path(p).name.startswith("libggml-base") for p in theirs), ggml_libs
    llama_dir = Path(result["llama_dir"]).resolve().parent
    assert all(llama_dir in Path(p).parents for p in theirs), theirs
