"""Move a file bigger than one device call's carry (64 MiB with the working tree) to the GPU machine in pieces.

Here: `python tools/ship_file.py split FILE` cuts FILE into pieces of < 60 MiB under .ship/NAME/ (git-ignored)
with a manifest (size, sha256, piece count) and prints the carry path of each piece. Then one device call per
piece, each within ~30 s of the last so the machine stays warm, carrying `.ship/NAME/manifest.json` and that
piece, runs

    python3 tools/ship_file.py receive .ship/NAME STAGING          # copies the carried piece(s) into STAGING

and, once all pieces are there, `python3 tools/ship_file.py assemble STAGING DEST` joins them in order and checks
size and sha256 (exit 1, saying which pieces are missing or that the hash differs, otherwise).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

PIECE = 58 * 2**20
ROOT = Path(__file__).resolve().parent.parent


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def split(file: Path) -> Path:
    out = ROOT / ".ship" / file.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    n = 0
    with open(file, "rb") as f:
        while block := f.read(PIECE):
            (out / f"{n:03d}").write_bytes(block)
            n += 1
    manifest = {"name": file.name, "size": file.stat().st_size, "sha256": _sha256(file), "pieces": n}
    (out / "manifest.json").write_text(json.dumps(manifest))
    for i in range(n):
        print(out.relative_to(ROOT) / f"{i:03d}")
    return out


def receive(folder: Path, staging: Path) -> None:
    staging.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / "manifest.json", staging / "manifest.json")
    for piece in sorted(folder.glob("[0-9][0-9][0-9]")):
        shutil.copy(piece, staging / piece.name)
        print(f"received {piece.name} ({piece.stat().st_size} bytes)")


def assemble(staging: Path, dest: Path) -> int:
    manifest = json.loads((staging / "manifest.json").read_text())
    missing = [f"{i:03d}" for i in range(manifest["pieces"]) if not (staging / f"{i:03d}").exists()]
    if missing:
        print(f"{manifest['name']}: pieces missing: {' '.join(missing)}")
        return 1
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as out:
        for i in range(manifest["pieces"]):
            with open(staging / f"{i:03d}", "rb") as f:
                shutil.copyfileobj(f, out)
    size, digest = dest.stat().st_size, _sha256(dest)
    if size != manifest["size"] or digest != manifest["sha256"]:
        print(f"{dest}: {size} bytes, sha256 {digest}; expected {manifest['size']} bytes, {manifest['sha256']}")
        return 1
    print(f"{dest}: {size} bytes, sha256 ok")
    return 0


def main(argv) -> int:
    if len(argv) == 2 and argv[0] == "split":
        split(Path(argv[1]))
        return 0
    if len(argv) == 3 and argv[0] == "receive":
        receive(Path(argv[1]), Path(argv[2]))
        return 0
    if len(argv) == 3 and argv[0] == "assemble":
        return assemble(Path(argv[1]), Path(argv[2]))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
