"""`pydflash serve --demo`, the main job's server: a synthetic target and DFlash draft served with speculative
decoding; its reply through the API is plain AR decoding's, and the timings carry the acceptance length."""
import openai
import pytest

import pydflash
from pydflash.server.demo import write_demo_pair

from server_helpers import ServeProcess

pytestmark = pytest.mark.slow
N = 12


def test_serve_demo_speculative_reply_equals_ar(tmp_path):
    server = ServeProcess("--demo", "--device", "cpu", "--max-ctx", "512")
    try:
        health = server.health()
        assert health["model"] == "pydflash-demo" and health["mode"] in ("ddtree", "chain")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(model="pydflash-demo", max_tokens=N,
                                             messages=[{"role": "user", "content": "Hello, world!"}])
    finally:
        server.close()
    target, _ = write_demo_pair(tmp_path)          # the same synthetic pair (fixed seed), decoded with plain AR
    ref = pydflash.load(target, mode="ar", device="cpu", max_ctx=512).generate("Hello, world!", max_tokens=N,
                                                                               chat=True)
    assert out.choices[0].message.content == ref.text
    assert out.usage.completion_tokens == len(ref.tokens)
    timings = out.model_extra["timings"]
    assert timings["predicted_n"] == len(ref.tokens) and timings["acceptance_length"] >= 1.0
