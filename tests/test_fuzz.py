"""The hardening fuzz run: >= 1,000 malformed files, parameters and chat templates from the seeded generator in
pydflash/fuzzing.py, in child processes under a time and memory limit. Fails on any signal (a native abort or
segfault), hang, unexpected exception type, refusal that does not name the file, or silent acceptance of a
corrupt input. A failing case is reproduced alone with `python -m pydflash.fuzzing run --first N --count 1`."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time

import pytest

N_CASES = int(os.environ.get("PYDFLASH_FUZZ_CASES", 2000))
SEED = int(os.environ.get("PYDFLASH_FUZZ_SEED", 0))
N_WORKERS = 2
CASE_SECONDS = 30          # one case: a hostile template stops after 2 s, a load of the tiny model takes < 1 s
START_SECONDS = 120        # a worker's start: imports and writing the base files
MEMORY_LIMIT = 4 << 30     # address space of a worker: a case asking for more must be refused, not attempted


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _run_range(first: int, count: int, results: list, failures: list, extra_args=(), env=None) -> None:
    """Run cases first..first+count-1 in workers, restarting after a case that killed or hung its worker."""
    env = {**(env or os.environ), "PYTHONFAULTHANDLER": "", "OMP_NUM_THREADS": "1"}
    index, end = first, first + count
    while index < end:
        proc = subprocess.Popen([sys.executable, "-m", "pydflash.fuzzing", "run", "--seed", str(SEED), "--first",
                                 str(index), "--count", str(end - index), *extra_args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_limit_memory)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        current, seen, deadline = None, 0, time.monotonic() + START_SECONDS
        while True:
            time.sleep(0.05)
            while seen < len(lines):
                msg = json.loads(lines[seen])
                seen += 1
                if "start" in msg:
                    current, deadline = msg["start"], time.monotonic() + CASE_SECONDS
                elif "index" in msg:
                    results.append(msg)
                    current, index = None, msg["index"] + 1
                elif "ready" in msg:
                    deadline = time.monotonic() + CASE_SECONDS
            if proc.poll() is not None and not reader.is_alive():
                break
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                reader.join()
                failures.append(f"case {current}: hang (no result in {CASE_SECONDS} s)")
                index = (current if current is not None else index) + 1
                break
        if proc.returncode not in (0, -9):
            tail = proc.stderr.read()[-1500:]
            if current is None:
                failures.append(f"worker failed before a case (status {proc.returncode}): {tail}")
                return
            failures.append(f"case {current}: the worker died with status {proc.returncode}: {tail}")
            index = current + 1


@pytest.mark.slow
def test_fuzz_no_crash_hang_or_silent_accept():
    results, failures = [], []
    per = -(-N_CASES // N_WORKERS)
    threads = [threading.Thread(target=_run_range, args=(w * per, min(per, N_CASES - w * per), results, failures))
               for w in range(N_WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        label = f"case {r['index']} ({r['kind']}: {r['what']})"
        if r.get("problem"):
            failures.append(f"{label}: {r['problem']}: {r['error']}")
        elif r["expect"] == "refuse" and r["outcome"] == "accepted":
            failures.append(f"{label}: silently accepted")
        elif r["expect"] == "accept" and r["outcome"] != "accepted":
            failures.append(f"{label}: refused a valid input: {r['error']}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])
    assert len(results) == N_CASES
    kinds = {r["kind"] for r in results}
    assert kinds >= {"target", "draft_dir", "draft_gguf", "load_params", "generate_params", "template"}


def test_harness_reports_a_native_abort_and_goes_on_without_attaching_gdb(tmp_path):
    """The harness itself: a case that aborts inside ggml is reported as that case's crash and the next cases
    still run. ggml's abort handler must not exec gdb (it stalls, and deadlocked with two threads): a fake gdb
    first on PATH would leave a mark."""
    mark = tmp_path / "gdb-ran"
    fake = tmp_path / "bin" / "gdb"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ntouch {mark}\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    env.pop("GGML_NO_BACKTRACE", None)
    results, failures = [], []
    _run_range(0, 3, results, failures, extra_args=("--abort-at", "1"), env=env)
    assert [r["index"] for r in results] == [0, 2]
    assert len(failures) == 1 and failures[0].startswith("case 1: the worker died with status -6")
    assert "self-test abort" in failures[0]
    assert not mark.exists()
