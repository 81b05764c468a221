"""What a user's install needs: no pydflash import path and not the main job (`pydflash demo`) may need the test
oracles (PyTorch, transformers, z-lab's dflash), which the README's set-up command does not install."""
import subprocess
import sys

import pytest

ORACLES = ("torch", "transformers", "dflash")

SCRIPT = """
import importlib, pkgutil, sys

class BlockOracles:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {oracles!r}:
            raise ImportError(name + " is a test oracle: pydflash must not need it")

sys.meta_path.insert(0, BlockOracles())
try:
    import torch
except ImportError:
    print("torch blocked")
import pydflash
for module in pkgutil.walk_packages(pydflash.__path__, "pydflash."):
    importlib.import_module(module.name)
print("imported", len(list(pkgutil.walk_packages(pydflash.__path__, "pydflash."))), "modules")
from pydflash import cli
sys.exit(cli.main(["demo", "--n-gen", "8"]))
""".format(oracles=ORACLES)


@pytest.mark.slow
def test_every_module_and_the_demo_run_without_the_oracles(tmp_path):
    # from a folder of its own: `python -c` puts the working directory first on sys.path, and a source checkout
    # there (without the compiled libraries) would shadow the installed package
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "torch blocked" in run.stdout
    assert "imported" in run.stdout and "same tokens as AR: yes" in run.stdout
