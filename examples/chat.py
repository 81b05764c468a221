"""A multi-turn chat on pydflash's llama-cpp-python-style API: the conversation is a list of messages, each
answer streams in and joins the history, the GGUF's chat template renders it all.

    python examples/chat.py                                        # synthetic pair, two scripted turns
    python examples/chat.py Qwen3.5-27B-Q4_K_M.gguf Qwen3.5-27B-DFlash/   # type your turns; empty line quits
"""
import sys
import tempfile

from pydflash import Llama
from pydflash.testing import synthetic_pair

SCRIPTED_TURNS = ["Hello! Who are you?", "Write one line of Python."]


def turns(scripted: bool):
    """The user's turns: a fixed script (synthetic run) or what is typed."""
    if scripted:
        for text in SCRIPTED_TURNS:
            print(f"user: {text}")
            yield text
        return
    while True:
        try:
            text = input("user: ").strip()
        except EOFError:
            return
        if not text:
            return
        yield text


def main(target=None, draft=None) -> None:
    scripted = target is None
    if scripted:
        target, draft = synthetic_pair(tempfile.mkdtemp(prefix="pydflash-chat-"))
    llm = Llama(target, draft_model_path=draft, n_ctx=512 if scripted else 8192)
    history = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
    for text in turns(scripted):
        history.append({"role": "user", "content": text})
        print("assistant: ", end="", flush=True)
        answer = ""
        for chunk in llm.create_chat_completion(history, max_tokens=32 if scripted else 512, stream=True):
            delta = chunk["choices"][0]["delta"]
            if "content" in delta:
                answer += delta["content"]
                print(delta["content"], end="", flush=True)
            reason = chunk["choices"][0]["finish_reason"]
        print(f"\n[{reason}]")
        history.append({"role": "assistant", "content": answer})
    print(f"conversation: {len(history)} messages")


if __name__ == "__main__":
    main(*sys.argv[1:3])
