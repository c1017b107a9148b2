"""The native kernels' build cache is held to the key files' rule (`owner_only`): every kvseal
process imports the built file, so a built file or a cache folder that another user may change
is never loaded; the kernels are then built into a private folder of the process instead.

A two-line source stands in for `csrc/` (the rule is the build folder's, not the kernels'), so
each build here takes a fraction of a second."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvseal import owner_only
from kvseal.ops.native_build import HEADER, BuildConfig, build


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[BuildConfig]:
    """A build of a one-function source into `$XDG_CACHE_HOME/kvseal/native`, XDG_CACHE_HOME a
    fresh folder of this test's; the private folders a build made instead are removed after it."""
    if shutil.which(BuildConfig.from_environment().compiler) is None:
        pytest.skip("no C compiler")
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / HEADER).write_text("#ifndef KVSEAL_OPS_H\n#define KVSEAL_OPS_H\nint kvseal_answer(void);\n#endif\n")
    (csrc / "answer.c").write_text(f'#include "{HEADER}"\nint kvseal_answer(void) {{ return 42; }}\n')
    home = tmp_path / "xdg"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    private: dict[Path, Path] = {}
    monkeypatch.setattr(owner_only, "_stand_ins", private)
    yield replace(BuildConfig.from_environment(), flags=("-O0", "-fopenmp"), csrc=csrc,
                  cache_root=home / "kvseal" / "native")
    for folder in private.values():
        shutil.rmtree(folder)


def test_the_cache_folders_are_made_owner_only_whatever_the_umask(config: BuildConfig) -> None:
    old = os.umask(0)
    try:
        path, _, _ = build(config)
    finally:
        os.umask(old)
    assert path.parent.parent == config.cache_root
    for folder in (config.cache_root.parent, config.cache_root, path.parent):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    again, _, seconds = build(config)
    assert again == path and seconds == 0.0  # found again, not built again


@pytest.mark.parametrize("change", ["writable by others", "another user's"])
def test_a_built_file_another_user_may_change_is_never_loaded_but_built_again(
        config: BuildConfig, change: str, caplog: pytest.LogCaptureFixture) -> None:
    cached, _, _ = build(config)
    if change == "writable by others":
        cached.chmod(0o666)
    else:
        if os.getuid() != 0:
            pytest.skip("giving a file to another user takes root")
        os.chown(cached, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="kvseal"):
        path, _, seconds = build(config)
    assert path == cached and seconds > 0  # built again in its place, not loaded
    st = path.stat()
    assert st.st_mode & 0o022 == 0 and st.st_uid == os.getuid()
    warned = [r.getMessage() for r in caplog.records if "built again" in r.getMessage()]
    assert warned and ("chmod go-w" in warned[0] or "chown" in warned[0]), warned


@pytest.mark.parametrize("level", ["XDG_CACHE_HOME", "kvseal", "native"])
def test_a_cache_folder_others_may_write_is_not_used(config: BuildConfig, level: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    cached, _, _ = build(config)
    folder = {"XDG_CACHE_HOME": config.cache_root.parent.parent, "kvseal": config.cache_root.parent,
              "native": config.cache_root}[level]
    folder.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="kvseal"):
        path, _, seconds = build(config)
    assert path != cached and not path.is_relative_to(config.cache_root) and seconds > 0
    assert any(str(folder) in r.getMessage() and "XDG_CACHE_HOME" in r.getMessage() for r in caplog.records)
