"""`pydflash run` with llama.cpp's flag spellings, --file, --system, --raw and the sampling flags."""
import pytest

import pydflash
from pydflash import cli
from pydflash.testing import write_dflash_draft, write_qwen35_gguf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_flags") / "tiny.gguf"
    write_qwen35_gguf(path, seed=4)
    return str(path)


@pytest.fixture(scope="module")
def ar(model):
    return pydflash.load(model, device="cpu", max_ctx=512)


def test_llama_cpp_spellings_are_aliases():
    parse = cli.build_parser().parse_args
    ours = parse(["run", "--target", "t.gguf", "--draft", "d", "--max-ctx", "4096", "--n-gen", "64", "--prompt",
                  "hi", "--kv", "q8_0", "--budget", "16", "--system", "sys"])
    llama = parse(["run", "-m", "t.gguf", "-md", "d", "-c", "4096", "-n", "64", "-p", "hi", "-ctk", "q8_0",
                   "--draft-max", "16", "-sys", "sys", "-ngl", "99"])
    long = parse(["run", "--model", "t.gguf", "--model-draft", "d", "--ctx-size", "4096", "--n-predict", "64",
                  "--cache-type-k", "q8_0", "--system-prompt", "sys", "--prompt", "hi", "--draft-max", "16"])
    fields = ("target", "draft", "max_ctx", "n_gen", "prompt", "kv", "budget", "system")
    assert [getattr(llama, f) for f in fields] == [getattr(ours, f) for f in fields] == \
        [getattr(long, f) for f in fields] == ["t.gguf", "d", 4096, 64, "hi", "q8_0", 16, "sys"]
    assert llama.n_gpu_layers == 99
    sampling = parse(["run", "-m", "t", "--temp", "0.7", "--top-k", "20", "--seed", "3"])
    assert cli.sampling_options(sampling) == {"temperature": 0.7, "top_k": 20, "seed": 3}
    assert cli.sampling_options(parse(["run", "-m", "t"])) == {}


def test_run_with_llama_cpp_flags(model, ar, capsys):
    assert cli.main(["run", "-m", model, "-p", "The quick", "-n", "12", "-c", "256", "-ngl", "99",
                     "--device", "cpu"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == ar.generate("The quick", max_tokens=12).text


def test_run_file_and_system_prompt(model, ar, capsys, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("What is a fox?", encoding="utf-8")
    assert cli.main(["run", "-m", model, "-f", str(prompt_file), "-sys", "Be brief.", "-n", "10", "-c", "256",
                     "--device", "cpu"]) == 0
    templated = ar.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "What is a fox?"}])
    assert templated.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    expected = ar.generate(ar.tokenizer.tokenize(templated), max_tokens=10).text
    assert capsys.readouterr().out.rstrip("\n") == expected


def test_run_refuses_conflicting_or_unsupported_flags(model, capsys):
    assert cli.main(["run", "-m", model, "-p", "hi", "--raw", "--chat", "-c", "256", "--device", "cpu"]) == 2
    assert "--raw" in capsys.readouterr().err
    assert cli.main(["run", "-m", model, "-p", "hi", "-f", "x.txt", "-c", "256", "--device", "cpu"]) == 2
    assert "not both" in capsys.readouterr().err
    # sampling flags reach the engine, checked before the model loads
    assert cli.main(["run", "-m", model, "-p", "hi", "--temp", "-0.8", "-n", "4", "-c", "256",
                     "--device", "cpu"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert cli.main(["run", "-m", model, "-p", "hi", "--temp", "0.8", "--seed", "1", "-n", "4", "-c", "256",
                     "--device", "cpu"]) == 0
    assert cli.main(["run", "-m", model, "-p", "hi", "--temp", "0", "-n", "4", "-c", "256", "--device", "cpu"]) == 0


def test_run_with_draft_flags(model, ar, capsys, tmp_path):
    write_dflash_draft(tmp_path / "draft", model, seed=1)
    assert cli.main(["run", "-m", model, "-md", str(tmp_path / "draft"), "--draft-max", "4", "-p", "The quick",
                     "-n", "10", "-c", "256", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip("\n") == ar.generate("The quick", max_tokens=10).text
    assert "mode ddtree" in err
