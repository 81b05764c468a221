"""The chat page in headless Chromium (Debian's `chromium`, driven over the DevTools protocol): type a
message, press Enter, watch the reply stream in, check it is the engine's greedy reply and that the page shows
tok/s; keep a screenshot."""
import base64
import json
import os
import shutil
import subprocess
import time

import httpx
import pytest

import pydflash
from pydflash.server.demo import DEMO_TEMPLATE
from pydflash.testing import write_qwen35_gguf

from server_helpers import ServeProcess

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CTX = 160
MESSAGE = "Hello, world!"


class DevTools:
    """A minimal DevTools-protocol client over one page's websocket."""

    def __init__(self, ws_url: str):
        import websocket
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve-page") / "tiny.gguf"
    write_qwen35_gguf(path, seed=2, chat_template=DEMO_TEMPLATE)
    srv = ServeProcess("--target", str(path), "--mode", "ar", "--device", "cpu", "--max-ctx", str(CTX),
                       "--alias", "pydflash-demo")
    yield srv, str(path)
    srv.close()


@pytest.fixture
def browser(served, tmp_path):
    if CHROMIUM is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium)")
    profile = tmp_path / "profile"
    proc = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}",
                             "--window-size=1000,640", served[0].url + "/"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.monotonic() < deadline and proc.poll() is None, "chromium did not start"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = []
        while not pages:
            assert time.monotonic() < deadline, "chromium opened no page"
            pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"]
            time.sleep(0.1)
        tools = DevTools(pages[0]["webSocketDebuggerUrl"])
        yield tools
        tools.ws.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_type_a_message_and_see_the_streamed_reply(served, browser, tmp_path):
    server, model_path = served
    engine = pydflash.load(model_path, mode="ar", device="cpu", max_ctx=CTX)
    ids = engine.tokenizer.tokenize(engine.tokenizer.apply_chat_template([{"role": "user", "content": MESSAGE}]))
    ref = engine.generate(MESSAGE, max_tokens=CTX - len(ids), chat=True)   # the page leaves max_tokens unset

    page = browser
    page.wait("document.readyState === 'complete' && document.getElementById('model').textContent === "
              "'pydflash-demo'", 30, "the page and the model name")
    page.eval("window.updates = 0; new MutationObserver(() => window.updates++).observe("
              "document.getElementById('log'), {subtree: true, childList: true, characterData: true})")
    page.eval("document.getElementById('input').focus()")
    page.call("Input.insertText", text=MESSAGE)
    for kind in ("keyDown", "keyUp"):
        page.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13,
                  **({"text": "\r"} if kind == "keyDown" else {}))
    stats = page.wait("document.querySelector('.assistant .stats') && "
                      "document.querySelector('.assistant .stats').textContent", 120, "the reply to finish")
    reply = page.eval("document.querySelector('.assistant span').textContent")
    assert page.eval("document.querySelector('.user').textContent") == MESSAGE
    assert reply == ref.text
    assert f"{len(ref.tokens)} tokens" in stats and "tok/s" in stats
    assert page.eval("window.updates") > 3                         # the reply arrived in pieces
    assert page.eval("document.querySelectorAll('.error').length") == 0

    shot = base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"])
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 5000
    (tmp_path / "chat-page.png").write_bytes(shot)
    if os.environ.get("PYDFLASH_SCREENSHOT"):                     # refresh docs/chat-page.png
        with open(os.environ["PYDFLASH_SCREENSHOT"], "wb") as f:
            f.write(shot)
