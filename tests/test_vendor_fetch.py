"""vendor/fetch_ggml.py: hash pinning, offline builds from a local archive, and strict patch application."""
from __future__ import annotations

import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FETCH = REPO / "vendor" / "fetch_ggml.py"

spec = importlib.util.spec_from_file_location("fetch_ggml", FETCH)
fetch_ggml = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fetch_ggml)

# Any attempt to reach a package index fails at once: nothing listens on port 9 (discard) of loopback.
OFFLINE_ENV = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "",
               "PIP_NO_INDEX": "1", "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}


def pinned_archive() -> Path:
    """The genuine archive, left in the cache by the README's install command (which fetched it with pip)."""
    path = fetch_ggml.cache_dir() / fetch_ggml.PIN["archive"]
    assert path.is_file(), f"{path} missing: run the README's set-up command first (it caches the archive)"
    return path


def run_fetch(dest: Path, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PYDFLASH_GGML")}
    full_env.update(OFFLINE_ENV, PYDFLASH_CACHE_DIR=str(dest.parent / "empty-cache"), **env)
    return subprocess.run([sys.executable, str(FETCH), "--dest", str(dest)], capture_output=True, text=True,
                          env=full_env, timeout=600)


def test_tampered_archive_is_rejected(tmp_path):
    # same name and layout as the real archive, different bytes
    fake = tmp_path / fetch_ggml.PIN["archive"]
    with tarfile.open(fake, "w:gz") as tar:
        data = b"#pragma once\n"
        info = tarfile.TarInfo(fetch_ggml.PIN["subpath"] + "/include/ggml.h")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    result = run_fetch(tmp_path / "ggml", PYDFLASH_GGML_ARCHIVE=str(fake))
    assert result.returncode == 1
    assert str(fake) in result.stderr and "sha256" in result.stderr and fetch_ggml.PIN["sha256"] in result.stderr
    assert not (tmp_path / "ggml").exists()


def test_local_archive_offline_gives_patched_trimmed_tree(tmp_path):
    archive = tmp_path / "archives"
    archive.mkdir()
    os.symlink(pinned_archive(), archive / fetch_ggml.PIN["archive"])
    dest = tmp_path / "ggml"
    result = run_fetch(dest, PYDFLASH_GGML_ARCHIVE=str(archive))  # a folder holding the archive works too
    assert result.returncode == 0, result.stderr
    # patched: the op hooks of vendor/patches/0001 are in
    assert '#include "ggml-ext-ops.def"' in (dest / "include" / "ggml.h").read_text()
    assert "ggml_ext_cpu_compute_forward" in (dest / "src" / "ggml-cpu" / "ggml-cpu.c").read_text()
    # trimmed: only the backends we build
    backends = {p.name for p in (dest / "src").iterdir() if p.is_dir()}
    assert backends == {"ggml-cpu", "ggml-cuda"}
    # a second run with the same inputs reuses the tree (the stamp matches)
    stamp_time = (dest / ".pydflash-stamp").stat().st_mtime_ns
    assert run_fetch(dest, PYDFLASH_GGML_ARCHIVE=str(archive)).returncode == 0
    assert (dest / ".pydflash-stamp").stat().st_mtime_ns == stamp_time


@pytest.mark.slow
def test_offline_build_from_local_archive(tmp_path):
    """Configure and compile ggml-base (which holds the ggml_ext constructors) with no index reachable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYDFLASH_")}
    env.update(OFFLINE_ENV, PYDFLASH_GGML_ARCHIVE=str(pinned_archive()), PYDFLASH_CACHE_DIR=str(tmp_path / "c"))
    build = tmp_path / "build"
    cmake = shutil.which("cmake")
    assert cmake, "cmake is needed (the README's set-up installs it)"
    configure = subprocess.run([cmake, "-S", str(REPO), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                                f"-DPython_EXECUTABLE={sys.executable}"], capture_output=True, text=True, env=env)
    assert configure.returncode == 0, configure.stdout[-2000:] + configure.stderr[-2000:]
    compiled = subprocess.run([cmake, "--build", str(build), "--target", "ggml-base", "-j", "2"],
                              capture_output=True, text=True, env=env)
    assert compiled.returncode == 0, compiled.stdout[-3000:] + compiled.stderr[-2000:]
    lib = next(build.rglob("libpydflash-ggml-base.so"))
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    assert "ggml_ssm_conv_tree" in symbols and "ggml_ext_abi_version" in symbols


# --- the patch applier -------------------------------------------------------------------------------------

def make_tree(root: Path) -> None:
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.c").write_text("int a;\nint b;\nint c;\n")


def write_patch(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


def test_patch_applies_at_its_stated_lines(tmp_path):
    make_tree(tmp_path / "t")
    patch = write_patch(tmp_path / "p.patch", "about this patch\n--- a/src/a.c\n+++ b/src/a.c\n"
                        "@@ -1,2 +1,3 @@\n int a;\n+int a2;\n int b;\n@@ -3,1 +4,2 @@\n int c;\n+int d;\n")
    fetch_ggml.apply_patch(patch, tmp_path / "t")
    assert (tmp_path / "t" / "src" / "a.c").read_text() == "int a;\nint a2;\nint b;\nint c;\nint d;\n"


def test_patch_with_an_offset_is_refused(tmp_path):
    make_tree(tmp_path / "t")
    patch = write_patch(tmp_path / "p.patch", "--- a/src/a.c\n+++ b/src/a.c\n"
                        "@@ -5,2 +5,3 @@\n int b;\n+int b2;\n int c;\n")  # the context is at line 2, not 5
    with pytest.raises(fetch_ggml.FetchError, match=r"at line 2, not at line 5"):
        fetch_ggml.apply_patch(patch, tmp_path / "t")
    assert (tmp_path / "t" / "src" / "a.c").read_text() == "int a;\nint b;\nint c;\n"


def test_patch_with_ambiguous_context_is_refused(tmp_path):
    (tmp_path / "t" / "src").mkdir(parents=True)
    (tmp_path / "t" / "src" / "a.c").write_text("case 1:\n    break;\nx;\ncase 1:\n    break;\n")
    patch = write_patch(tmp_path / "p.patch", "--- a/src/a.c\n+++ b/src/a.c\n"
                        "@@ -3,2 +3,3 @@\n case 1:\n+    y();\n     break;\n")   # stated line 3: neither copy
    with pytest.raises(fetch_ggml.FetchError, match=r"at lines 1, 4, not at line 3"):
        fetch_ggml.apply_patch(patch, tmp_path / "t")


def test_patch_that_does_not_apply_names_patch_and_file(tmp_path):
    make_tree(tmp_path / "t")
    patch = write_patch(tmp_path / "0042-x.patch", "--- a/src/a.c\n+++ b/src/a.c\n@@ -1,2 +1,2 @@\n int a;\n"
                        "-int zzz;\n+int y;\n")
    with pytest.raises(fetch_ggml.FetchError) as err:
        fetch_ggml.apply_patch(patch, tmp_path / "t")
    assert "0042-x.patch" in str(err.value) and "src/a.c" in str(err.value) and "regenerate" in str(err.value)
    assert (tmp_path / "t" / "src" / "a.c").read_text() == "int a;\nint b;\nint c;\n"


def test_patch_creating_a_file(tmp_path):
    make_tree(tmp_path / "t")
    patch = write_patch(tmp_path / "p.patch", "--- /dev/null\n+++ b/src/new.h\n@@ -0,0 +1,2 @@\n+#pragma once\n"
                        "+int n;\n")
    fetch_ggml.apply_patch(patch, tmp_path / "t")
    assert (tmp_path / "t" / "src" / "new.h").read_text() == "#pragma once\nint n;\n"


def test_failed_patch_stops_materialise_without_leaving_a_tree(tmp_path, monkeypatch):
    src = tmp_path / "pristine"
    (src / "include").mkdir(parents=True)
    (src / "include" / "ggml.h").write_text("nothing the real patches expect\n")
    (src / "src").mkdir()
    monkeypatch.setenv("PYDFLASH_GGML_SOURCE", str(src))
    dest = tmp_path / "out"
    with pytest.raises(fetch_ggml.FetchError) as err:
        fetch_ggml.materialise(dest)
    assert "0001-ggml-ext-op-hooks.patch" in str(err.value)
    assert not dest.exists()
