#!/usr/bin/env python3
"""Materialise the pinned, patched ggml source tree that the build compiles.

Upstream ggml is never committed. This script finds the pinned archive (vendor/pin.json), checks its sha256,
extracts only the parts the build needs and applies vendor/patches/*.patch in order. Where it looks:

  PYDFLASH_GGML_SOURCE   an already-extracted pristine ggml tree (the archive's ggml folder, or the unpacked
                         archive root); patches are applied to a copy, the tree itself is left untouched
  PYDFLASH_GGML_ARCHIVE  the archive file itself (or a folder holding it), for offline machines
  PYDFLASH_CACHE_DIR     where a downloaded archive is kept (default: $XDG_CACHE_HOME/pydflash or
                         ~/.cache/pydflash); if the archive is not there it is fetched with
                         `pip download`, so the user's own pip configuration (index, proxy) applies

Usage: python vendor/fetch_ggml.py --dest DIR      (prints DIR on success; exits 1 with a reason otherwise)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VENDOR = Path(__file__).resolve().parent
PIN = json.loads((VENDOR / "pin.json").read_text())
PATCH_DIR = VENDOR / "patches"


class FetchError(Exception):
    """A problem the user can act on; the message says which file and what to do."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_archive(path: Path) -> Path:
    if not path.is_file():
        raise FetchError(f"{path}: no such file (expected the {PIN['archive']} source archive)")
    digest = sha256_of(path)
    if digest != PIN["sha256"]:
        raise FetchError(
            f"{path}: sha256 is {digest}, but vendor/pin.json pins {PIN['sha256']}. The archive is corrupt or "
            f"not the pinned {PIN['package']}=={PIN['version']} source; delete it and build again, or point "
            f"PYDFLASH_GGML_ARCHIVE at a genuine copy."
        )
    return path


def cache_dir() -> Path:
    if os.environ.get("PYDFLASH_CACHE_DIR"):
        return Path(os.environ["PYDFLASH_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pydflash"


def locate_archive() -> Path:
    """The verified archive: from PYDFLASH_GGML_ARCHIVE, else the cache, else pip download into the cache."""
    given = os.environ.get("PYDFLASH_GGML_ARCHIVE")
    if given:
        p = Path(given)
        return verify_archive(p / PIN["archive"] if p.is_dir() else p)
    cached = cache_dir() / PIN["archive"]
    if cached.is_file():
        return verify_archive(cached)
    cached.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PIN["package"],
           "--no-build-isolation", "--dest", str(cached.parent), f"{PIN['package']}=={PIN['version']}"]
    print(f"pydflash: fetching {PIN['archive']} with pip (set PYDFLASH_GGML_ARCHIVE to use a local copy)",
          file=sys.stderr)
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    if result.returncode != 0 or not cached.is_file():
        raise FetchError(
            f"`{' '.join(cmd)}` failed (exit {result.returncode}). With no network, download "
            f"{PIN['archive']} elsewhere and set PYDFLASH_GGML_ARCHIVE to its path."
        )
    return verify_archive(cached)


def wanted(rel: str) -> bool:
    """Whether a path relative to the ggml root is part of what the build needs."""
    parts = rel.split("/")
    if parts[0] not in PIN["keep"]:
        return False
    return not (len(parts) > 2 and parts[0] == "src" and parts[1] in PIN["skip_backends"])


def extract_archive(archive: Path, dest: Path, subpath: str = PIN["subpath"], keep=wanted) -> None:
    """Extract the files and folders under `subpath` that `keep(relative path)` accepts, relative to subpath."""
    prefix = subpath.rstrip("/") + "/"
    with tarfile.open(archive, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and keep(m.name[len(prefix):]) and (m.isfile() or m.isdir()):
                m.name = m.name[len(prefix):]
                members.append(m)
        if not members:
            raise FetchError(f"{archive}: holds nothing under {subpath}")
        tar.extractall(dest, members=members, filter="data")


def copy_source(src: Path, dest: Path) -> None:
    root = src / PIN["subpath"] if (src / PIN["subpath"]).is_dir() else src
    if not (root / "include" / "ggml.h").is_file():
        raise FetchError(f"PYDFLASH_GGML_SOURCE={src}: no include/ggml.h there or under {PIN['subpath']}")
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and wanted(rel):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / rel)


# --- patches -------------------------------------------------------------------------------------------------

HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_patch(text: str, name: str) -> list[tuple[str | None, str, list[tuple[int, list[str], list[str]]]]]:
    """[(old_path or None for a new file, new_path, [(old_start, old_lines, new_lines)])] of a unified diff."""
    files = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1
            continue
        old = lines[i][4:].split("\t")[0]
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise FetchError(f"{name}: line {i + 2}: '+++' header expected after '---'")
        new = lines[i + 1][4:].split("\t")[0]
        strip = lambda p: None if p == "/dev/null" else p.split("/", 1)[1]  # noqa: E731 (drop a/ b/)
        hunks = []
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = HUNK.match(lines[i])
            if not m:
                raise FetchError(f"{name}: line {i + 1}: malformed hunk header {lines[i]!r}")
            n_old = int(m.group(2) or 1)
            n_new = int(m.group(4) or 1)
            before, after = [], []
            i += 1
            while (len(before) < n_old or len(after) < n_new) and i < len(lines):
                tag, body = lines[i][:1], lines[i][1:]
                if tag in (" ", ""):
                    before.append(body)
                    after.append(body)
                elif tag == "-":
                    before.append(body)
                elif tag == "+":
                    after.append(body)
                elif tag != "\\":
                    raise FetchError(f"{name}: line {i + 1}: unexpected {lines[i]!r} inside a hunk")
                i += 1
            if len(before) != n_old or len(after) != n_new:
                raise FetchError(f"{name}: hunk at line {i} is shorter than its header says")
            hunks.append((int(m.group(1)), before, after))
        files.append((strip(old), strip(new), hunks))
    if not files:
        raise FetchError(f"{name}: no file changes found in the patch")
    return files


def find_block(haystack: list[str], block: list[str]) -> list[int]:
    """Every index where block occurs in haystack."""
    return [k for k in range(len(haystack) - len(block) + 1) if haystack[k:k + len(block)] == block]


def apply_patch(patch: Path, root: Path) -> None:
    """Apply a unified diff strictly: each hunk's context must sit exactly at its stated line (after the
    shift of the hunks before it). A hunk whose context is found only elsewhere is refused rather than moved:
    with the pin fixed, an offset means the patch and the tree disagree, and nearest-match placement could
    silently patch a look-alike block (a repeated switch case, a second overload)."""
    for old, new, hunks in parse_patch(patch.read_text(), patch.name):
        target = root / new
        if old is None:
            if target.exists():
                raise FetchError(f"{patch.name}: creates {new}, which already exists in the pinned tree")
            content: list[str] = []
        elif not target.is_file():
            raise FetchError(f"{patch.name}: patches {new}, which the pinned tree does not have")
        else:
            content = target.read_text().splitlines()
        shift = 0
        regenerate = (f"The patch was written for {PIN['upstream']}; if the pin changed, regenerate the patch "
                      f"against the new tree.")
        for start, before, after in hunks:
            at = max(start - 1, 0) + shift
            if content[at:at + len(before)] != before:
                hits = find_block(content, before) if before else []
                where = ("its context is not in the file" if not hits else
                         f"its context is at line{'s' if len(hits) > 1 else ''} {', '.join(str(h + 1) for h in hits)}"
                         f", not at line {at + 1} (offset or ambiguous placements are refused)")
                raise FetchError(f"{patch.name}: hunk '@@ -{start}' does not apply to {new}: {where}. {regenerate}")
            content[at:at + len(before)] = after
            shift += len(after) - len(before)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(content) + "\n")


# --- main ------------------------------------------------------------------------------------------------------

def materialise(dest: Path) -> Path:
    patches = sorted(PATCH_DIR.glob("*.patch"))
    source = os.environ.get("PYDFLASH_GGML_SOURCE")
    stamp_parts = [PIN["sha256"], f"source={source or ''}"] + [f"{p.name}:{sha256_of(p)}" for p in patches]
    stamp = hashlib.sha256("\n".join(stamp_parts).encode()).hexdigest()
    if (dest / ".pydflash-stamp").is_file() and (dest / ".pydflash-stamp").read_text() == stamp:
        return dest
    work = dest.with_name(dest.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if source:
        copy_source(Path(source), work)
    else:
        extract_archive(locate_archive(), work)
    for patch in patches:
        apply_patch(patch, work)
    (work / ".pydflash-stamp").write_text(stamp)
    shutil.rmtree(dest, ignore_errors=True)
    work.rename(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", required=True, type=Path, help="folder to hold the patched ggml tree")
    args = parser.parse_args(argv)
    try:
        print(materialise(args.dest.resolve()))
    except FetchError as e:
        print(f"pydflash: cannot prepare the ggml source: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
