"""The kernels' C sources ship with the package: a wheel built from this tree (a non-editable
install) holds every file of `kvseal/ops/csrc/`, and the kernels build and run from where that
wheel installs them (an editable install reads them from the tree itself)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvseal.ops.native_build import CSRC, BuildConfig

ROOT = Path(__file__).resolve().parents[2]
FROM_THE_WHEEL = """
import sys
from dataclasses import replace
from pathlib import Path
import torch
from kvseal.ops import native_build
assert native_build.CSRC.is_relative_to(sys.argv[1]), native_build.CSRC
config = replace(native_build.BuildConfig.from_environment(), flags=("-O0", "-fopenmp"), cache_root=Path(sys.argv[2]))
module = native_build.load(config).module
x = torch.tensor([[1.0, 3.0, 2.0]])
out = torch.empty(1, dtype=torch.int64)
cast = module.ffi.cast
module.lib.kvseal_argmax_rows(cast("float *", x.data_ptr()), 1, 3, cast("int64_t *", out.data_ptr()), 1)
print("argmax", int(out[0]))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this tree, built from a copy of it (no build files left in the tree)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "kvseal", source / "kvseal", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out)], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"no wheel could be built here (setuptools missing?): {done.stderr[-1000:]}")
    return next(out.glob("kvseal-*.whl"))


def test_the_wheel_holds_every_source_file(wheel: Path) -> None:
    shipped = {Path(name).name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("kvseal/ops/csrc/")}
    assert shipped == {p.name for p in CSRC.iterdir() if p.suffix in (".c", ".h")}


def test_the_kernels_build_and_run_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    if shutil.which(BuildConfig.from_environment().compiler) is None:
        pytest.skip("no C compiler")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", FROM_THE_WHEEL, str(site), str(tmp_path / "cache")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "argmax 1" in run.stdout, run.stderr[-3000:]
