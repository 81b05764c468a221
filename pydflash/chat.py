"""`pydflash chat`: a terminal chat on the public API.

Each turn renders the whole conversation with the GGUF's chat template; the engine's prefix cache resumes it
from the previous turn's saved state, so only the new part is prefilled. The reply streams as tokens are
committed; Ctrl+C stops it (the turn is kept up to there), Ctrl+D leaves.
"""
from __future__ import annotations

import signal
import sys

HELP = ("commands: /reset (forget the conversation), /stats (the last turn's numbers), /max N (new tokens per "
        "reply), /help; Ctrl+C stops a reply, Ctrl+D exits")


class _Interrupt:
    """While active, Ctrl+C sets a flag (checked between decode steps) instead of raising KeyboardInterrupt, so a
    reply stops at a step boundary with the engine's state intact."""

    def __init__(self):
        self.hit = False

    def __enter__(self):
        self.hit = False
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.hit = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)
        return False


def turn_summary(stats: dict, interrupted: bool) -> str:
    """One line per reply: tokens, decode speed, acceptance length and how much of the prompt was reused."""
    line = (f"[{stats['new_tokens']} tokens, {stats['decode_tok_s']:.1f} tok/s, acceptance length "
            f"{stats['acceptance_length']:.2f}, prompt {stats['prompt_tokens']} tokens: "
            f"{stats['reused_tokens']} reused, {stats['prefilled_tokens']} prefilled")
    return line + (", interrupted]" if interrupted else "]")


def stats_report(stats: dict) -> str:
    if not stats:
        return "no turn yet"
    keys = ("mode", "prompt_tokens", "reused_tokens", "prefilled_tokens", "new_tokens", "steps",
            "acceptance_length", "prefill_tok_s", "decode_tok_s")
    return "\n".join(f"  {k}: {stats[k]:.2f}" if isinstance(stats[k], float) else f"  {k}: {stats[k]}"
                     for k in keys if k in stats)


class ChatSession:
    """The conversation (messages in the chat template's format) and one reply at a time."""

    def __init__(self, engine, *, system: str | None = None, max_tokens: int = 512, sampling: dict | None = None):
        if engine.tokenizer is None:
            raise ValueError("chat needs the model's tokenizer and chat template")
        if not engine.tokenizer.chat_template:
            raise ValueError(f"{engine.tokenizer.path}: the GGUF has no tokenizer.chat_template to chat with")
        self.engine, self.system, self.max_tokens = engine, system, max_tokens
        self.sampling = dict(sampling or {})   # Engine.stream's sampling keywords, the same for every reply
        self.messages: list[dict] = []
        self.last_stats: dict = {}
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.engine.reset()

    def prompt_ids(self) -> list[int]:
        # message contents as plain text: a user typing "<|im_end|>" must not forge a turn
        return self.engine.tokenizer.chat_ids(self.messages)

    def reply(self, text: str, write, stop=lambda: False) -> tuple[str, bool]:
        """Add a user turn, stream the reply through write(piece) until done or stop() is true; the reply (as
        far as it got) joins the conversation. Returns (reply, interrupted)."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.prompt_ids()
            pieces, interrupted = [], False
            stream = self.engine.stream(ids, max_tokens=self.max_tokens, **self.sampling)
            for piece in stream:
                pieces.append(piece)
                write(piece)
                if stop():
                    interrupted = True
                    break
            stream.close()
        except ValueError:
            self.messages.pop()         # e.g. the conversation no longer fits the context
            raise
        reply = "".join(pieces)
        self.messages.append({"role": "assistant", "content": reply})
        self.last_stats = dict(self.engine.last_stats)
        return reply, interrupted


def repl(session: ChatSession, *, out=sys.stdout, err=sys.stderr, read=input) -> int:
    """Read a line, answer it, until end of input (Ctrl+D)."""
    print(f"pydflash chat ({session.engine.mode}); {HELP}", file=err)
    while True:
        try:
            line = read("> ")
        except EOFError:
            print(file=out)
            return 0
        except KeyboardInterrupt:       # Ctrl+C at the prompt drops the line
            print(file=out)
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            _command(session, line, err)
            continue

        def write(piece):
            out.write(piece)
            out.flush()

        with _Interrupt() as interrupt:
            try:
                _, interrupted = session.reply(line, write, stop=lambda: interrupt.hit)
            except ValueError as e:
                print(f"\nerror: {e} (/reset starts a new conversation)", file=err)
                continue
        out.write("\n")
        out.flush()
        print(turn_summary(session.last_stats, interrupted), file=err, flush=True)


def _command(session: ChatSession, line: str, err) -> None:
    name, _, arg = line.partition(" ")
    if name == "/reset":
        session.reset()
        print("conversation cleared", file=err)
    elif name == "/stats":
        print(stats_report(session.last_stats), file=err)
    elif name == "/max" and arg.strip().isdigit() and int(arg) > 0:
        session.max_tokens = int(arg)
        print(f"replies of at most {session.max_tokens} tokens", file=err)
    else:
        print(HELP, file=err)
