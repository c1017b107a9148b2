"""The engine links' keys (I9): `kvseal keys generate` writes key files no other user can read,
and every PD command refuses to start without keys, or with keys it cannot trust, naming the
flags and how to make them. The safe behaviour is the default: there is no flag to turn
authentication off."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq.auth

from kvseal.cli import main
from kvseal.disagg.link_keys import (
    EngineLinkKeys,
    KeyPair,
    load_key_pair,
    load_public_key_list,
    load_public_keys,
)
from kvseal.errors import ConfigError
from kvseal.owner_only import UnsafeFile


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    folder = tmp_path / "keys"
    assert main(["keys", "generate", "--dir", str(folder), "frontend", "prefill", "decode"]) == 0
    return folder


def test_generate_writes_a_public_file_and_an_owner_only_secret_file(keys: Path) -> None:
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for name in ("frontend", "prefill", "decode"):
        public, secret = keys / f"{name}.key", keys / f"{name}.key_secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        pair = load_key_pair(secret)
        assert pair.name == name and zmq.auth.load_certificate(public) == (pair.public, None)
        assert pair.secret not in public.read_bytes()
    assert sorted(p.name for p in keys.iterdir()) == sorted(f"{n}.{s}" for n in ("frontend", "prefill", "decode")
                                                             for s in ("key", "key_secret")), "no temporary left"


def test_generate_never_overwrites_a_key(keys: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = (keys / "decode.key_secret").read_bytes()
    assert main(["keys", "generate", "--dir", str(keys), "decode"]) == 2
    assert "never overwritten" in capsys.readouterr().err
    assert (keys / "decode.key_secret").read_bytes() == before


@pytest.mark.parametrize("name", ["../escape", "a b", ".hidden", ""])
def test_generate_refuses_a_name_that_is_not_a_plain_file_name(tmp_path: Path, name: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "generate", "--dir", str(tmp_path / "keys"), name]) == 2
    assert "key name" in capsys.readouterr().err


@pytest.mark.parametrize("folder", ["a-file", "a-file/sub"])
def test_generate_refuses_a_folder_that_cannot_be_made(tmp_path: Path, folder: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("{}")
    assert main(["keys", "generate", "--dir", str(tmp_path / folder), "a"]) == 2
    assert f"cannot write keys to {tmp_path / folder}: " in capsys.readouterr().err


@pytest.mark.parametrize("listen", ["127.0.0.1:9", "10.0.0.5:9"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_engine_without_keys_refuses_to_start_naming_the_flags(listen: str, role: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["engine", "--role", role, "--listen", listen]) == 2
    err = capsys.readouterr().err
    for needed in ("--link-key", "--frontend-keys", "kvseal keys generate", "loopback too"):
        assert needed in err, err
    assert ("--peer-keys" in err) == (role == "decode")


def engine_argv(keys: Path, role: str = "decode", link_key: str | None = None, peers: bool = True) -> list[str]:
    argv = ["engine", "--role", role, "--listen", "127.0.0.1:9", "--link-key",
            link_key or str(keys / f"{role}.key_secret"), "--frontend-keys", str(keys / "frontend.key"),
            "--threads", "0"]  # refused after the keys, so nothing loads
    return [*argv, "--peer-keys", str(keys / "prefill.key")] if peers else argv


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_key_flags_that_pass_reach_the_next_check(keys: Path, role: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The README's commands: `kvseal keys generate --dir keys frontend prefill decode`, then each
    engine names the key files it accepts."""
    assert main(engine_argv(keys, role, peers=role == "decode")) == 2
    assert "kvseal: error: --threads" in capsys.readouterr().err  # the keys were fine


def test_a_folder_of_frontend_keys_only_passes(keys: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    frontends = tmp_path / "frontends"
    assert main(["keys", "generate", "--dir", str(frontends), "frontend-a", "frontend-b"]) == 0
    argv = engine_argv(keys, "prefill", peers=False)
    argv[argv.index("--frontend-keys") + 1] = str(frontends)
    assert main(argv) == 2
    assert "kvseal: error: --threads" in capsys.readouterr().err


@pytest.mark.parametrize(("role", "flag", "spec", "own_file"), [
    ("prefill", "--frontend-keys", "{keys}", "prefill.key"),  # the folder `keys generate` wrote all keys into
    ("prefill", "--frontend-keys", "{keys}/frontend.key,{keys}/prefill.key", "prefill.key"),
    ("decode", "--frontend-keys", "{keys}", "decode.key"),
    ("decode", "--peer-keys", "{keys}/prefill.key,{keys}/decode.key", "decode.key"),
])
def test_an_engine_refuses_its_own_key_on_an_allow_list(keys: Path, role: str, flag: str, spec: str, own_file: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Whoever stole an engine's key pair must not be able to act as a frontend (stop it, read its
    stats, push prefill compute anywhere) or as a peer of that engine."""
    argv = engine_argv(keys, role, peers=role == "decode")
    argv[argv.index(flag) + 1] = spec.format(keys=keys)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"kvseal: error: {flag}: {keys / own_file} is this engine's own public key" in err, err


@pytest.mark.parametrize(("change", "expected"), [
    ("public key as --link-key", "holds no secret key"),
    ("secret readable by others", "chmod 600"),
    ("no such file", "no key file"),
    ("decode without --peer-keys", "needs --peer-keys"),
    ("prefill with --peer-keys", "applies to --role decode only"),
    ("frontend key as a peer too", "not both"),
])
def test_an_engine_refuses_keys_it_cannot_trust(keys: Path, change: str, expected: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    argv = engine_argv(keys)
    if change == "public key as --link-key":
        argv = engine_argv(keys, link_key=str(keys / "decode.key"))
    elif change == "secret readable by others":
        os.chmod(keys / "decode.key_secret", 0o644)
    elif change == "no such file":
        argv = engine_argv(keys, link_key=str(keys / "nobody.key_secret"))
    elif change == "decode without --peer-keys":
        argv = engine_argv(keys, peers=False)
    elif change == "prefill with --peer-keys":
        argv = [*engine_argv(keys, role="prefill", peers=False), "--peer-keys", str(keys / "decode.key")]
    else:
        argv = [*argv[:-2], "--peer-keys", f"{keys / 'prefill.key'},{keys / 'frontend.key'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err, err


def frontend_argv(keys: Path, prefill_keys: str, pd: bool = False) -> list[str]:
    topology = ["--pd"] if pd else ["--prefill", "127.0.0.1:9,127.0.0.1:10", "--decode", "127.0.0.1:11"]
    return ["serve", *topology, "--link-key", str(keys / "frontend.key_secret"), "--prefill-keys", prefill_keys,
            "--decode-keys", str(keys / "decode.key")]


def test_a_pd_frontend_without_keys_refuses_to_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:10"]) == 2
    err = capsys.readouterr().err
    for needed in ("--link-key", "--prefill-keys", "--decode-keys", "kvseal keys generate"):
        assert needed in err, err


def test_a_pd_frontend_needs_one_key_per_engine(keys: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(frontend_argv(keys, str(keys / "prefill.key"))) == 2  # two prefill engines, one key
    assert "one key file per engine" in capsys.readouterr().err


def test_serve_pd_makes_its_own_keys_and_takes_none(keys: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(frontend_argv(keys, str(keys / "prefill.key"), pd=True)) == 2
    assert "throw-away keys" in capsys.readouterr().err


def test_public_keys_load_from_files_and_folders_once_each(keys: Path) -> None:
    loaded = load_public_keys(f"{keys},{keys / 'frontend.key'}", "--frontend-keys")
    assert sorted(k.name for k in loaded) == ["decode", "frontend", "prefill"]
    with pytest.raises(ConfigError, match="holds no"):
        load_public_keys(str(keys.parent), "--frontend-keys")  # a folder without key files


def test_a_key_pair_never_shows_its_secret() -> None:
    pair = KeyPair.ephemeral("x")
    assert pair.secret.decode() not in repr(pair) and pair.secret.decode() not in repr(
        EngineLinkKeys(pair, (KeyPair.ephemeral("frontend").public_key(),)))


@pytest.mark.parametrize(("flag", "loosened", "mode"), [
    ("--frontend-keys", "frontend.key", 0o666), ("--frontend-keys", "shared", 0o777),
    ("--peer-keys", "prefill.key", 0o646), ("--link-key", "decode.key_secret", 0o620), ("--link-key", ".", 0o775)])
def test_an_engine_refuses_key_files_other_users_may_write(keys: Path, flag: str, loosened: str, mode: int,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Whoever can write an allow-list (the file, or the folder it is in) can add their own key
    and be a frontend at the next restart: refused, naming the flag, the path and the fix."""
    argv = engine_argv(keys)
    if loosened == "shared":  # the frontend's key in a folder of its own, e.g. /srv/keys (0777)
        (keys.parent / "shared").mkdir()
        (keys.parent / "shared" / "frontend.key").write_bytes((keys / "frontend.key").read_bytes())
        argv[argv.index("--frontend-keys") + 1] = str(keys.parent / "shared" / "frontend.key")
    path = (keys.parent / "shared") if loosened == "shared" else (keys / loosened).resolve()
    os.chmod(path, mode)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{flag}: " in err and f"chmod go-w {path}" in err, err


@pytest.mark.parametrize("spec", ["frontend.key", "."])
def test_a_group_writable_allow_list_is_refused_and_an_owner_only_one_loads(keys: Path, spec: str) -> None:
    path = keys / spec
    os.chmod(keys / "frontend.key", 0o664)
    with pytest.raises(UnsafeFile, match=f"chmod go-w {keys / 'frontend.key'}"):
        load_public_keys(str(path), "--frontend-keys")
    os.chmod(keys / "frontend.key", 0o644)
    os.chmod(keys, 0o770)
    with pytest.raises(UnsafeFile, match=f"the folder of .* {keys} can be written"):
        load_public_keys(str(path), "--frontend-keys")
    os.chmod(keys, 0o755)  # readable by all is fine: public keys are not secrets
    assert load_public_keys(str(path), "--frontend-keys")


@pytest.mark.parametrize("spec", ["linked.key", "."])
def test_a_key_file_linked_into_a_folder_others_may_write_is_refused(keys: Path, tmp_path: Path, spec: str) -> None:
    """A link in a safe folder reads its target: the target's folder is the one that must be
    safe, or another user could rename their own key over the target."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    (shared / "frontend.key").write_bytes((keys / "frontend.key").read_bytes())
    os.chmod(shared / "frontend.key", 0o644)
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o700)
    (safe / "linked.key").symlink_to(shared / "frontend.key")
    with pytest.raises(UnsafeFile, match=f"{shared} can be written"):
        load_public_keys(str(safe / spec), "--frontend-keys")
    os.chmod(shared, 0o755)
    assert load_public_keys(str(safe / spec), "--frontend-keys")


def test_a_frontend_refuses_engine_keys_other_users_may_write(keys: Path) -> None:
    os.chmod(keys / "decode.key", 0o646)
    with pytest.raises(UnsafeFile, match="chmod go-w"):
        load_public_key_list(str(keys / "decode.key"), "--decode-keys")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_key_file_owned_by_another_user_is_refused(keys: Path, what: str) -> None:
    os.chown(keys / "frontend.key" if what == "file" else keys, 65534, -1)
    with pytest.raises(UnsafeFile, match="owned by user id 65534"):
        load_public_keys(str(keys / "frontend.key"), "--frontend-keys")


def test_generate_refuses_a_folder_other_users_may_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o777)
    assert main(["keys", "generate", "--dir", str(folder), "frontend"]) == 2
    assert f"chmod go-w {folder}" in capsys.readouterr().err
    assert not list(folder.iterdir()), "nothing written"
