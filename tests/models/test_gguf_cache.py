"""The GGUF conversion cache (`loader.convert_gguf`, `model_files.gguf_cache_dir`): a folder is
used only when it says it was made from this very file, and only while no user but this one
(or root) may change it or the folders above it; two processes converting at once both start.

Each test converts the tiny Q4_1 GGUF of test_gguf_q4_rows (two layers, a byte tokenizer) into
its own cache (`XDG_CACHE_HOME` under tmp_path). What a folder holds is told by its final norm:
float32 in the GGUF, copied as it is by the conversion."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_gguf_q4_rows import write_tiny_gguf

from kvseal.bench.dataset import converted_folder
from kvseal.model_files import GgufSource, gguf_cache_dir
from kvseal.models import loader
from kvseal.models.gguf_blocks import BLOCKS_FILE, read_gguf_blocks
from kvseal.models.loader import convert_gguf, folder_config


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`XDG_CACHE_HOME`, not made yet: kvseal makes it. The temporary folders a process converts
    into where the cache cannot be used (removed when it exits) are made in tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path / "cache"


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.Q4_1.gguf", seed=0)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """umask 000: any mode the cache's folders and files get is the one kvseal asks for."""
    old = os.umask(0)
    yield
    os.umask(old)


def norm_of_folder(folder: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))["model.norm.weight"]


def norm_of_gguf(path: Path) -> np.ndarray:
    from gguf import GGUFReader

    return np.array(next(t for t in GGUFReader(str(path)).tensors if t.name == "output_norm.weight").data)


def plant(folder: Path, mode: int = 0o700) -> None:
    """A folder that looks converted (weights, config) but holds another model's norm: what a
    user who could write the cache would leave there."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({"model.norm.weight": np.full(64, 7.0, dtype=np.float32)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")
    os.chmod(folder, mode)


def is_genuine(folder: Path, path: Path) -> bool:
    return bool(np.array_equal(norm_of_folder(folder), norm_of_gguf(path)))


def writable_by_others(path: Path) -> bool:
    return bool(path.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH))


# 1. the folder is the file's: the key and the stamp the folder keeps


def test_a_gguf_replaced_in_place_with_the_same_size_and_mtime_is_converted_again(
        cache: Path, gguf: Path, tmp_path: Path) -> None:
    """`cp -p`, `rsync -t`, `tar x`: another model, same path, same size, same mtime (same inode
    too, written in place); only its ctime tells."""
    first = convert_gguf(gguf)
    before = gguf.stat()
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)
    assert other.stat().st_size == before.st_size
    gguf.write_bytes(other.read_bytes())
    os.utime(gguf, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (gguf.stat().st_size, gguf.stat().st_mtime_ns, gguf.stat().st_ino) == \
        (before.st_size, before.st_mtime_ns, before.st_ino)
    second = convert_gguf(gguf)
    assert is_genuine(second, gguf) and not is_genuine(second, write_tiny_gguf(tmp_path / "old.gguf", seed=0))
    assert second != first


def test_two_copies_of_a_file_at_one_path_keep_a_folder_each_and_a_third_version_removes_the_oldest(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers sharing one cache, each with its own copy of the GGUF at the same path (its own
    inode and ctime: another source). Each container's file is one of the files here, seen at
    one shared path: after one conversion each, their starts by turns use their own folders and
    convert nothing again; a third version removes the oldest folder."""
    shared = "/models/model.gguf"
    real_of = GgufSource.of.__func__  # type: ignore[attr-defined]

    def seen_at_the_shared_path(cls: type[GgufSource], path: Path) -> GgufSource:
        return dataclasses.replace(real_of(cls, path), path=shared)

    monkeypatch.setattr(GgufSource, "of", classmethod(seen_at_the_shared_path))
    a, b, c = (write_tiny_gguf(tmp_path / f"{name}.gguf", seed=seed) for name, seed in (("a", 0), ("b", 1), ("c", 2)))
    folder_a = convert_gguf(a)
    folder_b = convert_gguf(b)
    assert folder_a != folder_b and folder_a.exists() and is_genuine(folder_b, b)
    write = loader._write_hf_folder
    converted: list[Path] = []
    monkeypatch.setattr(loader, "_write_hf_folder", lambda path, out: converted.append(path))
    assert (convert_gguf(a), convert_gguf(b), convert_gguf(a)) == (folder_a, folder_b, folder_a)
    assert not converted, "a start by turns converted again"
    monkeypatch.setattr(loader, "_write_hf_folder", write)
    folder_c = convert_gguf(c)
    assert is_genuine(folder_c, c) and folder_b.exists() and not folder_a.exists(), "the oldest one goes"


def test_a_folder_that_does_not_name_its_file_is_converted_again(cache: Path, gguf: Path) -> None:
    """A folder at the file's key without the stamp of this file (an older kvseal's, or one made by
    hand) is not trusted."""
    plant(gguf_cache_dir(gguf))
    folder = convert_gguf(gguf)
    assert is_genuine(folder, gguf)
    assert convert_gguf(gguf) == folder  # and converted once: the next start uses it


# 2. the folder is this user's alone


@pytest.mark.parametrize("loosened", ["model.safetensors", BLOCKS_FILE, "the folder"])
def test_a_cache_folder_or_file_others_may_write_is_converted_again(
        cache: Path, gguf: Path, loosened: str, caplog: pytest.LogCaptureFixture) -> None:
    folder = convert_gguf(gguf)
    plant(folder)  # the folder's stamp kept: only the mode says it was open to others
    (folder / BLOCKS_FILE).write_bytes(b"planted")
    os.chmod(folder if loosened == "the folder" else folder / loosened, 0o777 if loosened == "the folder" else 0o666)
    with caplog.at_level(logging.WARNING, logger="kvseal"):
        again = convert_gguf(gguf)
    assert again == folder and is_genuine(again, gguf)
    assert not (again / BLOCKS_FILE).exists(), "the kept blocks went with the folder"
    assert "can be written by users other than its owner" in caplog.text and "converted again" in caplog.text


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("what", ["folder", "file"])
def test_a_cache_folder_or_file_of_another_user_is_converted_again(cache: Path, gguf: Path, what: str) -> None:
    folder = convert_gguf(gguf)
    plant(folder)
    os.chown(folder if what == "folder" else folder / "model.safetensors", 65534, -1)
    assert is_genuine(convert_gguf(gguf), gguf)


@pytest.mark.parametrize("level", ["XDG_CACHE_HOME", "kvseal", "kvseal/gguf"])
def test_a_cache_others_may_write_is_not_used_and_the_model_still_loads(
        cache: Path, gguf: Path, level: str, caplog: pytest.LogCaptureFixture) -> None:
    """Anyone who may write a folder above the converted ones can put their own there: the model
    is converted into a private folder of this process instead, with a warning naming the fix."""
    planted = gguf_cache_dir(gguf)
    plant(planted)
    loosened = cache if level == "XDG_CACHE_HOME" else cache / level
    os.chmod(loosened, 0o777)
    with caplog.at_level(logging.WARNING, logger="kvseal"):
        folder = convert_gguf(gguf)
    assert is_genuine(folder, gguf) and not folder.is_relative_to(cache)
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
    assert gguf_cache_dir(gguf) == folder, "the kept blocks are looked for in the same private folder"
    assert not is_genuine(planted, gguf), "the cache is left as it was"
    assert f"chmod go-w {loosened}" in caplog.text and "XDG_CACHE_HOME" in caplog.text


def test_a_cache_that_cannot_be_made_still_loads(cache: Path, gguf: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache.write_text("a file where the cache's folder would be")
    with caplog.at_level(logging.WARNING, logger="kvseal"):
        folder = convert_gguf(gguf)
    assert is_genuine(folder, gguf) and not folder.is_relative_to(cache)
    assert str(cache) in caplog.text


def test_a_cache_that_cannot_be_written_still_loads(cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A cache that passes the owner rule but cannot take a new conversion (a read-only mount of a
    baked cache, after the GGUF was copied with `cp -a`: another inode, another key): the model is
    converted into a private folder, and the kept blocks are looked for there too."""
    convert_gguf(gguf)
    copied = gguf.with_name("copied.gguf")
    copied.write_bytes(gguf.read_bytes())
    copied.replace(gguf)  # the same bytes under a new inode: converted again
    made = tempfile.mkdtemp

    def read_only_cache(*args: object, **kwargs: object) -> str:
        if Path(str(kwargs.get("dir", ""))).is_relative_to(cache):
            raise OSError(errno.EROFS, "Read-only file system", str(kwargs["dir"]))
        return made(*args, **kwargs)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(tempfile, "mkdtemp", read_only_cache)
    with caplog.at_level(logging.WARNING, logger="kvseal"):
        folder = convert_gguf(gguf)
    assert is_genuine(folder, gguf) and not folder.is_relative_to(cache)
    assert gguf_cache_dir(gguf) == folder, "the kept blocks are looked for in the same private folder"
    assert "Read-only file system" in caplog.text and "XDG_CACHE_HOME" in caplog.text


def test_the_bench_finds_a_conversion_where_the_cache_is_not_used(cache: Path, gguf: Path) -> None:
    """The bench keeps torch out of its process and has a child convert: into the bench's own
    private folder, not the child's (which goes when the child exits)."""
    gguf_cache_dir(gguf)  # makes the cache's folders
    os.chmod(cache, 0o777)
    folder = converted_folder(gguf)
    assert not folder.is_relative_to(cache) and is_genuine(folder, gguf)
    assert (folder / "config.json").is_file()


def test_the_cache_is_made_owner_only_whatever_the_umask(cache: Path, gguf: Path, open_umask: None) -> None:
    """And what kvseal writes there later (the kept GGUF blocks) does not make the next start
    convert again."""
    folder = convert_gguf(gguf)
    for made in (cache, cache / "kvseal", cache / "kvseal" / "gguf", folder):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
    assert read_gguf_blocks(gguf, folder_config(str(gguf))).layers is not None and (folder / BLOCKS_FILE).exists()
    assert not [f for f in folder.rglob("*") if writable_by_others(f)]
    assert convert_gguf(gguf) == folder and (folder / BLOCKS_FILE).exists()  # used at the next start


# 3. two processes converting at once


def test_the_slower_of_two_conversions_uses_the_finished_folder(
        cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other process renames its folder into place while this one converts: this one's rename
    then meets a folder that is not empty (ENOTEMPTY, not FileExistsError)."""
    write = loader._write_hf_folder
    others: list[Path] = []

    def write_while_another_finishes(path: Path, out: Path) -> None:
        write(path, out)
        if not others:
            others.append(Path())  # the other process's conversion runs once, to its end
            others[0] = convert_gguf(path)

    monkeypatch.setattr(loader, "_write_hf_folder", write_while_another_finishes)
    folder = convert_gguf(gguf)
    assert folder == others[0] and is_genuine(folder, gguf)
    assert [p.name for p in folder.parent.iterdir()] == [folder.name], "the slower one's folder is removed"


def test_a_folder_another_process_left_that_is_not_this_files_is_replaced(
        cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slower process checks the folder it lost to, as a start does, and takes it only where
    it is this file's conversion."""
    write = loader._write_hf_folder

    def write_while_another_plants(path: Path, out: Path) -> None:
        write(path, out)
        plant(gguf_cache_dir(path))

    monkeypatch.setattr(loader, "_write_hf_folder", write_while_another_plants)
    folder = convert_gguf(gguf)
    assert is_genuine(folder, gguf)
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]
