"""llama.cpp as a peer in `pydflash bench`: its plain AR decoding and its classic draft-model speculative decoding
on the very prompts pydflash decodes, greedy, timed by llama.cpp itself.

Two programs of the pinned llama.cpp, built on pydflash's own ggml by tools/build_llama_bench.sh:

  llama-simple              greedy AR. Decode speed from its perf counters: "eval time = T ms / N runs" counts
                            only the one-token evaluations, so the prompt's batch is left out (pydflash's AR tok/s
                            likewise divides the tokens after the first by the time after the prefill).
  llama-speculative-simple  target + draft model, one draft of up to --spec-draft-n-max tokens per target batch.
                            Its "decoded N tokens in S seconds" starts after the prompt is encoded; acceptance
                            rate = n_accept / n_drafted as it prints them.

Both take the prompt as text and tokenize it themselves (add_special, parse_special), so each prompt is handed
over as the text whose tokens, under the same rules and the same llama.cpp version (llama-cpp-python), are
exactly pydflash's prompt ids; a prompt for which no such text exists is an error, never a silent mismatch.
Both echo the prompt and then print the generated pieces on stdout; the generated text is what follows the echo.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

AR_PROGRAM = "llama-simple"
SPEC_PROGRAM = "llama-speculative-simple"
BUILD_HINT = "build them with tools/build_llama_bench.sh LLAMA_SRC BUILD_DIR (docs/benchmarks.md)"


class PeerError(RuntimeError):
    """A llama.cpp peer program is missing, failed, or printed something this module cannot read."""


@dataclass
class PeerResult:
    text: bytes            # the generated pieces as printed (an ending token prints nothing)
    decoded: int           # tokens counted by the program's own timer
    decode_s: float
    drafted: int = 0       # speculative only
    accepted: int = 0

    @property
    def tok_s(self) -> float:
        return self.decoded / self.decode_s if self.decode_s > 0 else 0.0


def find_programs(bin_dir: str, speculative: bool) -> dict:
    """{"ar": path, "spec": path or None}; a PeerError naming each program that is absent or not executable."""
    wanted = {"ar": AR_PROGRAM, **({"spec": SPEC_PROGRAM} if speculative else {})}
    found, missing = {"spec": None}, []
    for kind, name in wanted.items():
        path = os.path.join(bin_dir, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            found[kind] = path
        else:
            missing.append(path)
    if missing:
        raise PeerError(f"llama.cpp peer program(s) not found: {', '.join(missing)}; {BUILD_HINT}")
    return found


def check_same_vocabulary(target_path: str, draft_path: str) -> None:
    """llama.cpp's speculative decoding needs the draft model to share the target's vocabulary; say where not."""
    from .gguf_io import GGUFFile

    def tokens(path):
        value = GGUFFile(path).get("tokenizer.ggml.tokens")
        if not isinstance(value, (list, tuple)) or not value:
            raise PeerError(f"{path}: no tokenizer.ggml.tokens, so it cannot be a llama.cpp draft or target")
        return list(value)

    mine, theirs = tokens(target_path), tokens(draft_path)
    # llama.cpp allows a few extra tokens at the end (added ones); the shared part must be equal
    if abs(len(mine) - len(theirs)) > 128:
        raise PeerError(f"llama.cpp draft {draft_path}: its vocabulary has {len(theirs)} tokens, the target "
                        f"{target_path} has {len(mine)}: the draft model must share the target's tokenizer")
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            raise PeerError(f"llama.cpp draft {draft_path}: token {i} is {b!r}, the target {target_path} has "
                            f"{a!r}: the draft model must share the target's tokenizer")


def prompt_text(tokenizer, text: str, chat: bool, ids: list[int]) -> str:
    """The text that llama.cpp's programs tokenize into exactly `ids` (pydflash's prompt for `text`)."""
    if chat:
        chat_ids, rendered = tokenizer.chat_prompt([{"role": "user", "content": text}])
        if chat_ids != list(ids):
            raise PeerError("the chat prompt's ids differ from the engine's (internal error)")
        text = rendered
    if tokenizer.tokenize(text, add_special=True, parse_special=True) != list(ids):
        raise PeerError(f"the prompt {text[:60]!r}... as text does not tokenize to pydflash's prompt ids under "
                        f"llama.cpp's rules (add_special, parse_special), so llama.cpp would decode a different "
                        f"prompt; run with --format raw")
    return text


def generated_bytes(tokenizer, tokens) -> bytes:
    """What the peers print for pydflash's generated `tokens` (a final ending token prints nothing)."""
    tokens = list(tokens)
    if tokens and tokenizer.is_end_of_generation(tokens[-1]):
        tokens = tokens[:-1]
    return b"".join(tokenizer.piece(t) for t in tokens)


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        out = subprocess.run(cmd, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise PeerError(f"{os.path.basename(cmd[0])} ran past {timeout:.0f} s") from e
    if out.returncode != 0:
        tail = out.stderr.decode("utf-8", "replace")[-1500:]
        raise PeerError(f"{os.path.basename(cmd[0])} exited with {out.returncode}:\n{tail}")
    return out


def _number(pattern: str, text: str, program: str) -> re.Match:
    m = re.search(pattern, text)
    if m is None:
        raise PeerError(f"{program}: no line matching {pattern!r} in its output")
    return m


def _after_echo(stdout: bytes, echo: bytes, program: str) -> bytes:
    at = stdout.find(echo)
    if at < 0:
        raise PeerError(f"{program}: its output does not start with the prompt it was given")
    return stdout[at + len(echo):]


def run_ar(program: str, model: str, text: str, echo: bytes, n_gen: int, *, timeout: float = 600) -> PeerResult:
    """llama-simple, greedy, n_gen new tokens after `text`. echo: the prompt's pieces (what it prints first)."""
    out = _run([program, "-m", model, "-n", str(n_gen), "-ngl", "99", text], timeout)
    err = out.stderr.decode("utf-8", "replace")
    m = _number(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", err, AR_PROGRAM)
    gen = _after_echo(out.stdout, echo, AR_PROGRAM)
    gen = gen[:-1] if gen.endswith(b"\n") else gen          # the newline it prints after the last token
    return PeerResult(gen, int(m.group(2)), float(m.group(1)) / 1e3)


def run_speculative(program: str, model: str, draft: str, text: str, echo: bytes, n_gen: int, draft_max: int, *,
                    n_ctx: int, timeout: float = 600) -> PeerResult:
    """llama-speculative-simple, greedy (temperature 0, top-k 1), drafts of up to draft_max tokens. The draft
    type is named: this llama.cpp infers it only for DFlash/MTP draft files and otherwise runs no speculation."""
    cmd = [program, "-m", model, "-md", draft, "-n", str(n_gen), "-p", text, "--no-escape", "-c", str(n_ctx),
           "-b", str(max(2048, n_ctx)), "-ngl", "99", "-ngld", "99", "--temp", "0", "--top-k", "1", "--seed", "0",
           "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0"]
    out = _run(cmd, timeout)
    err = out.stderr.decode("utf-8", "replace")
    m = _number(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", err, SPEC_PROGRAM)
    drafted = int(_number(r"n_drafted\s*=\s*(\d+)", err, SPEC_PROGRAM).group(1))
    accepted = int(_number(r"n_accept\s*=\s*(\d+)", err, SPEC_PROGRAM).group(1))
    gen = _after_echo(out.stdout, echo, SPEC_PROGRAM)
    gen = gen[:-4] if gen.endswith(b"\n" * 4) else gen        # the two blank-line pairs it prints after the text
    return PeerResult(gen, int(m.group(1)), float(m.group(2)), drafted, accepted)


@dataclass
class LlamaPeers:
    """What `pydflash bench --llama-bin DIR [--llama-draft GGUF] [--llama-draft-max N]` runs beside pydflash."""
    bin_dir: str
    target: str
    draft: str | None = None
    draft_max: int = 16

    def __post_init__(self):
        if not os.path.isdir(self.bin_dir):
            raise PeerError(f"--llama-bin {self.bin_dir}: not a folder; {BUILD_HINT}")
        if self.draft_max < 1:
            raise PeerError(f"--llama-draft-max {self.draft_max}: expected at least 1")
        if self.draft is not None:
            if not os.path.isfile(self.draft):
                raise PeerError(f"--llama-draft {self.draft}: no such file")
            check_same_vocabulary(self.target, self.draft)
        self.programs = find_programs(self.bin_dir, speculative=self.draft is not None)

    def run(self, tokenizer, text: str, chat: bool, ids: list[int], n_gen: int) -> dict:
        """Both peers on one prompt: {"ar": PeerResult, "spec": PeerResult or None}."""
        text = prompt_text(tokenizer, text, chat, ids)
        echo = b"".join(tokenizer.piece(t) for t in ids)
        result = {"ar": run_ar(self.programs["ar"], self.target, text, echo, n_gen), "spec": None}
        if self.programs["spec"]:
            result["spec"] = run_speculative(self.programs["spec"], self.target, self.draft, text, echo, n_gen,
                                             self.draft_max, n_ctx=len(ids) + n_gen + self.draft_max + 64)
        return result
