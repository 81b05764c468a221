"""The public API (pydflash.load / Engine / Result / stream) and the CLI's run and demo commands."""
import pytest

import pydflash
from pydflash import cli
from pydflash.testing import OracleDraft, write_qwen35_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("api") / "tiny.gguf"
    write_qwen35_gguf(path, seed=4)
    return str(path)


@pytest.fixture(scope="module")
def ar(model):
    return pydflash.load(model, device="cpu", max_ctx=512)


def test_load_defaults_to_ar_and_generates(ar):
    assert ar.mode == "ar"
    res = ar.generate("The quick brown fox", max_tokens=20)
    assert isinstance(res, pydflash.Result) and len(res.tokens) == 20
    assert res.text == ar.tokenizer.detokenize(res.tokens)
    for key in ("acceptance_length", "steps", "prefill_tok_s", "decode_tok_s"):
        assert key in res.stats
    assert res.stats["steps"] == 19 and res.stats["acceptance_length"] == 1.0


def test_token_id_prompt_and_stream_match_generate(ar):
    ids = ar.tokenizer.tokenize("Hello, world!", add_special=True)
    res = ar.generate(ids, max_tokens=24)
    assert res.tokens == ar.generate("Hello, world!", max_tokens=24).tokens
    pieces = list(ar.stream(ids, max_tokens=24))
    assert "".join(pieces) == res.text and len(pieces) > 1


def test_speculative_engine_equals_ar(model, ar):
    prompt = "def fibonacci(n):"
    ref = ar.generate(prompt, max_tokens=48)
    ids = ar.tokenizer.tokenize(prompt, add_special=True)
    draft = OracleDraft(ids + ref.tokens, ar.target.hp.n_vocab, error_positions=range(len(ids) + 3, 400, 7))
    spec = pydflash.load(model, draft, mode="chain", budget=15, device="cpu", max_ctx=512)
    res = spec.generate(prompt, max_tokens=48)
    assert res.tokens == ref.tokens and res.text == ref.text
    assert res.stats["acceptance_length"] > 3
    assert "".join(spec.stream(prompt, max_tokens=48)) == ref.text


def test_chat_prompt_uses_template(ar):
    res = ar.generate("hi", max_tokens=4, chat=True)
    templ = ar.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert res.tokens == ar.generate(ar.tokenizer.tokenize(templ), max_tokens=4).tokens


def test_rejects_bad_options(model, ar):
    with pytest.raises(ValueError, match="unknown sampling option"):
        ar.generate("x", max_tokens=2, temperture=0.7)
    with pytest.raises(ValueError, match="temperature"):
        ar.generate("x", max_tokens=2, temperature=-1)
    assert ar.generate("x", max_tokens=6, temperature=0.0).tokens == ar.generate("x", max_tokens=6).tokens
    with pytest.raises(ValueError, match="needs a draft"):
        pydflash.load(model, mode="ddtree", device="cpu")
    with pytest.raises(ValueError, match="mode"):
        pydflash.load(model, mode="fast", device="cpu")


def test_cli_run_streams_text(model, capsys, ar):
    assert cli.main(["run", "--target", model, "--prompt", "The quick", "--n-gen", "12", "--device", "cpu",
                     "--max-ctx", "256"]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip("\n") == ar.generate("The quick", max_tokens=12).text
    assert "acceptance length" in err and "decode" in err


def test_cli_run_samples_with_a_seed(model, capsys, ar):
    argv = ["run", "--target", model, "--prompt", "The quick", "--n-gen", "12", "--device", "cpu", "--max-ctx", "256",
            "--temperature", "0.8", "--top-p", "0.9", "--seed", "7"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.rstrip("\n") == ar.generate("The quick", max_tokens=12, temperature=0.8, top_p=0.9, seed=7).text
    assert cli.main(argv[:-6] + ["--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_cli_demo(capsys):
    assert cli.main(["demo", "--n-gen", "32"]) == 0
    out = capsys.readouterr().out
    assert "same tokens as AR: yes" in out and "acceptance length" in out


def test_cli_run_reads_stdin(model, capsys, monkeypatch, ar):
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello, world!"))
    assert cli.main(["run", "--target", model, "--n-gen", "8", "--device", "cpu", "--max-ctx", "256"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == ar.generate("Hello, world!", max_tokens=8).text
