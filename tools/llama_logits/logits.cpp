// llama-logits: llama.cpp's own logits along its greedy path, for tests that need llama.cpp on the same device as
// ours (tests/test_real_models.py compares our CUDA logits with llama.cpp's CUDA logits).
// Usage: llama-logits MODEL PROMPT_IDS N_STEPS OUT [N_GPU_LAYERS]
//   PROMPT_IDS  a text file of whitespace-separated token ids (at most 512)
//   OUT         written as raw float32: (N_STEPS + 1) rows of n_vocab logits, the prompt's last token's first,
//               then one per greedy token (the first largest logit, like numpy's argmax)
//   N_GPU_LAYERS  default 999 (all layers on the GPU); 0 keeps the model on the CPU
// The context matches the tests' llama-cpp-python one: 512 positions, one micro-batch for the prompt, flash
// attention, f16 K and V.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <vector>

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL PROMPT_IDS N_STEPS OUT [N_GPU_LAYERS]\n", argv[0]);
        return 2;
    }
    const int n_steps = atoi(argv[3]);
    std::vector<llama_token> prompt;
    {
        std::ifstream in(argv[2]);
        for (long id; in >> id;) prompt.push_back((llama_token) id);
    }
    const int n_ctx = 512;
    if (prompt.empty() || (int) prompt.size() + n_steps > n_ctx) {
        fprintf(stderr, "need 1..%d prompt tokens + steps, got %zu + %d\n", n_ctx, prompt.size(), n_steps);
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = argc > 5 ? atoi(argv[5]) : 999;
    mp.use_extra_bufts = false;   // plain weight layout, as the tests' llama-cpp-python reference
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cp.type_k = cp.type_v = GGML_TYPE_F16;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    FILE * out = fopen(argv[4], "wb");
    if (!out) { fprintf(stderr, "cannot write %s\n", argv[4]); return 1; }
    llama_batch batch = llama_batch_get_one(prompt.data(), (int32_t) prompt.size());
    llama_token token = 0;
    for (int step = 0; step <= n_steps; ++step) {
        if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "llama_decode failed at step %d\n", step); return 1; }
        const float * logits = llama_get_logits_ith(ctx, -1);
        if (fwrite(logits, sizeof(float), n_vocab, out) != (size_t) n_vocab) { fprintf(stderr, "write failed\n"); return 1; }
        token = 0;
        for (int i = 1; i < n_vocab; ++i) if (logits[i] > logits[token]) token = i;
        batch = llama_batch_get_one(&token, 1);
    }
    fclose(out);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
