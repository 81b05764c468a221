"""Talk to `pydflash serve` with the official `openai` client (pip install openai).

    python examples/openai_client.py                               # starts a server on the synthetic pair
    python examples/openai_client.py Qwen3.5-27B-Q4_K_M.gguf Qwen3.5-27B-DFlash/   # ... on your models
    python examples/openai_client.py --base-url http://127.0.0.1:8080/v1           # a server already running

Any OpenAI-compatible code works the same way: point base_url at the server, any api_key.
"""
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from openai import OpenAI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(target, draft) -> tuple[subprocess.Popen, str]:
    """`pydflash serve` in a child process; returns it and its base URL once /v1/models answers."""
    port = free_port()
    command = [sys.executable, "-m", "pydflash.cli", "serve", "--target", target, "--host", "127.0.0.1",
               "--port", str(port)] + (["--draft", draft] if draft else [])
    server = subprocess.Popen(command)
    base_url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 300          # loading a 27B model takes a while
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"pydflash serve exited with code {server.returncode}")
        try:
            urllib.request.urlopen(base_url + "/models", timeout=2)
            return server, base_url
        except OSError:
            time.sleep(0.5)
    server.terminate()
    sys.exit("pydflash serve did not answer within 300 s")


def talk(base_url: str, max_tokens: int) -> None:
    client = OpenAI(base_url=base_url, api_key="not-needed")
    model = client.models.list().data[0].id
    print(f"model: {model}")

    reply = client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "user", "content": "Write a haiku about GPUs."}])
    print(f"chat: {reply.choices[0].message.content!r} ({reply.usage.completion_tokens} tokens, "
          f"finish {reply.choices[0].finish_reason})")

    print("stream: ", end="")
    stream = client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Count from one to five."}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


def main(argv: list[str]) -> None:
    if argv[:1] == ["--base-url"]:
        talk(argv[1], max_tokens=256)
        return
    synthetic = not argv
    if synthetic:
        from pydflash.testing import synthetic_pair
        argv = list(synthetic_pair(tempfile.mkdtemp(prefix="pydflash-openai-")))
    server, base_url = start_server(argv[0], argv[1] if len(argv) > 1 else None)
    try:
        talk(base_url, max_tokens=24 if synthetic else 256)
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main(sys.argv[1:])
