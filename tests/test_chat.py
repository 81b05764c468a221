"""`pydflash chat` driven through a pseudo-terminal: streamed replies equal the engine's greedy output for the
conversation so far, turn 2 resumes from turn 1, Ctrl+C stops a reply and keeps it, /stats, Ctrl+D exits."""
import os
import re
import sys

import pexpect
import pytest

import pydflash
from pydflash import testing

SUMMARY = re.compile(r"\[(\d+) tokens, [\d.]+ tok/s, acceptance length ([\d.]+), prompt (\d+) tokens: (\d+) reused, "
                     r"(\d+) prefilled(, interrupted)?\]")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat")
    target, draft = str(tmp / "tiny.gguf"), str(tmp / "draft")
    testing.write_qwen35_gguf(target, seed=3)
    testing.write_dflash_draft(draft, target, seed=3)
    return target, draft


def spawn(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    child = pexpect.spawn(sys.executable, ["-m", "pydflash.cli", "chat", *args], env=env, encoding="utf-8",
                          timeout=120, dimensions=(50, 400))
    child.expect_exact("Ctrl+D exits")                   # the banner (the loader's log may hold "> " too)
    child.expect_exact("> ")
    return child


def say(child, line):
    """Send a user line; return (the streamed reply as printed, the summary's match)."""
    child.sendline(line)
    child.expect(SUMMARY)
    printed = child.before.replace("\r\n", "\n")
    assert printed.startswith(line + "\n")               # the terminal's echo of the typed line
    reply = printed[len(line) + 1:]
    assert reply.endswith("\n")
    return reply[:-1], child.match


def expected(engine, messages, n):
    tok = engine.tokenizer
    return engine.generate(tok.tokenize(tok.apply_chat_template(messages)), max_tokens=n).text


@pytest.mark.slow
def test_chat_repl_two_turns_interrupt_and_exit(pair):
    target, draft = pair
    n_gen = 12
    child = spawn("--target", target, "--draft", draft, "--device", "cpu", "--max-ctx", "2048",
                  "--n-gen", str(n_gen), "--system", "Be brief.")
    ref = pydflash.load(target, draft, device="cpu", max_ctx=2048, prefix_cache=False)
    messages = [{"role": "system", "content": "Be brief."}]

    messages.append({"role": "user", "content": "hello there"})
    reply1, m1 = say(child, "hello there")
    assert reply1 == expected(ref, messages, n_gen)
    assert int(m1[1]) == n_gen and int(m1[4]) == 0 and m1[6] is None
    messages.append({"role": "assistant", "content": reply1})
    child.expect_exact("> ")

    messages.append({"role": "user", "content": "tell me more"})
    reply2, m2 = say(child, "tell me more")
    assert reply2 == expected(ref, messages, n_gen)
    # turn 2 resumed: at least turn 1's whole prompt came from its snapshot
    prompt1 = len(ref.tokenizer.tokenize(ref.tokenizer.apply_chat_template(messages[:2])))
    assert int(m2[4]) >= prompt1 and int(m2[4]) + int(m2[5]) == int(m2[3])
    messages.append({"role": "assistant", "content": reply2})
    child.expect_exact("> ")

    # a long reply, stopped with Ctrl+C once it has started
    child.sendline("/max 1500")
    child.expect_exact("at most 1500 tokens")
    child.expect_exact("> ")
    child.sendline("go on")
    child.expect_exact("go on\r\n")
    child.expect(r"\S")                                   # the reply is streaming
    started = child.before + child.after
    child.sendintr()
    child.expect(SUMMARY)
    m3 = child.match
    assert m3[6] == ", interrupted" and 1 <= int(m3[1]) < 1500
    reply3 = (started + child.before).replace("\r\n", "\n")[:-1]
    child.expect_exact("> ")

    # the interrupted reply is part of the conversation, as far as it got
    messages += [{"role": "user", "content": "go on"}, {"role": "assistant", "content": reply3}]
    child.sendline(f"/max {n_gen}")
    child.expect_exact("> ")
    messages.append({"role": "user", "content": "and then?"})
    reply4, m4 = say(child, "and then?")
    assert reply4 == expected(ref, messages, n_gen)
    assert int(m4[4]) > prompt1
    child.expect_exact("> ")

    child.sendline("/stats")
    child.expect(r"reused_tokens: (\d+)")
    assert int(child.match[1]) > 0
    child.expect_exact("> ")

    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_chat_needs_a_target():
    child = pexpect.spawn(sys.executable, ["-m", "pydflash.cli", "chat"], encoding="utf-8", timeout=60,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    child.expect_exact("give --target")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 2


@pytest.mark.slow
def test_chat_demo_answers_and_reuses():
    """`pydflash chat --demo` needs nothing but the package; a second turn resumes from the first."""
    child = spawn("--demo", "--device", "cpu", "--n-gen", "6")
    _, m1 = say(child, "hi")
    child.expect_exact("> ")
    _, m2 = say(child, "again")
    assert int(m1[1]) == int(m2[1]) == 6
    assert int(m1[4]) == 0 and int(m2[4]) >= int(m1[3])
    child.expect_exact("> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.slow
def test_chat_session_samples_with_the_given_options(pair, capsys):
    """`pydflash chat`'s sampling flags reach every reply: a session with options and a seed replies exactly what
    Engine.generate draws with them for the same conversation; a bad value is refused before anything loads."""
    from pydflash import cli
    from pydflash.chat import ChatSession

    target, _ = pair
    options = dict(temperature=0.9, top_p=0.95, repeat_penalty=1.2, seed=11)
    session = ChatSession(pydflash.load(target, device="cpu", max_ctx=512), max_tokens=10, sampling=options)
    reply, interrupted = session.reply("hello there", write=lambda piece: None)
    ref = pydflash.load(target, device="cpu", max_ctx=512, prefix_cache=False)
    tok = ref.tokenizer
    ids = tok.tokenize(tok.apply_chat_template([{"role": "user", "content": "hello there"}]), add_special=False)
    assert not interrupted
    assert reply == ref.generate(ids, max_tokens=10, **options).text
    assert reply != ref.generate(ids, max_tokens=10).text          # it did sample
    assert cli.main(["chat", "--demo", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
