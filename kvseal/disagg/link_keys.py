"""The keys of the engine links (I9): files, key pairs, and who may talk to an engine.

Every link to an engine (frontend -> engine, prefill -> decode) is CurveZMQ: the engine is the
CURVE server and proves itself with its key pair; a client proves itself with its own, and the
engine lets it in only if its public key is on one of the engine's allow-lists (`link_auth.py`).

Key files are pyzmq's certificate format (`zmq.auth`): `NAME.key` holds a public key (give it
to whoever must accept NAME), `NAME.key_secret` the public and the secret key (mode 0600; only
NAME's own process reads it). `kvseal keys generate --dir DIR NAME...` writes both. A key's
name is its file name without the suffix; engines log and count by it.

Every key file read, and the folder it is in (a link's target and its folder too), must be
writable by its owner only, and owned by this user or root (as OpenSSH requires of
authorized_keys; `owner_only.refuse_unsafe`): whoever can write an allow-list can add their own
key to it and become a frontend or a peer at the next restart.

Public keys are not secrets: the frontend logs the engines' keys it uses. A secret key never
leaves its file, or, for `kvseal serve --pd`, the memory of the frontend and the engine it
spawned (handed over on multiprocessing's pipe, never in argv or the environment).
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from kvseal.errors import ConfigError
from kvseal.owner_only import refuse_unsafe

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
Z85_KEY_LEN = 40  # a CURVE key, z85-encoded
KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
KEY_STAKE = "put their own key in an allow-list, or swap a key pair"  # what `refuse_unsafe` guards here
KEYS_HINT = "make them with `kvseal keys generate --dir DIR NAME...`"


def is_curve_key(key: bytes) -> bool:
    """Whether `key` is a CURVE key in z85, the form ZMQ's key socket options take."""
    if len(key) != Z85_KEY_LEN:
        return False
    try:
        z85.decode(key)
    except (KeyError, ValueError):  # a byte outside z85's alphabet
        return False
    return True


@dataclass(frozen=True)
class PublicKey:
    """Someone's CURVE public key (z85, 40 bytes) and the name it goes by in logs and counts;
    `path`: the file it was read from (named in start-up refusals), None for a key made in memory."""

    name: str
    key: bytes
    path: Path | None = None

    def __str__(self) -> str:
        return str(self.path) if self.path is not None else self.name

    def __post_init__(self) -> None:
        if len(self.key) != Z85_KEY_LEN:
            raise ConfigError(f"the public key of {self.name!r} is {len(self.key)} bytes; a CURVE key is "
                              f"{Z85_KEY_LEN} z85 characters")


@dataclass(frozen=True)
class KeyPair:
    """One process's own CURVE identity. The secret never appears in a repr or a log line."""

    name: str
    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def ephemeral(cls, name: str) -> KeyPair:
        """A fresh pair that lives only in memory (`serve --pd`)."""
        public, secret = zmq.curve_keypair()
        return cls(name, public, secret)

    def public_key(self) -> PublicKey:
        return PublicKey(self.name, self.public)


@dataclass(frozen=True)
class EngineLinkKeys:
    """An engine's own pair and its allow-lists: `frontends` may use the whole frontend protocol
    (reserve, prefill, abort, hello, stats, integrity, shutdown); `peers` (decode only: the
    prefill engines) may send KV, commits and transfer aborts, nothing else."""

    own: KeyPair
    frontends: tuple[PublicKey, ...]
    peers: tuple[PublicKey, ...] = ()

    def __post_init__(self) -> None:
        if not self.frontends:
            raise ConfigError(f"an engine needs at least one frontend key (--frontend-keys); {KEYS_HINT}")
        _refuse_own_key(self.own, self.frontends, "--frontend-keys", "the frontends'")
        _refuse_own_key(self.own, self.peers, "--peer-keys", "the prefill engines'")
        both = {k.key for k in self.frontends} & {k.key for k in self.peers}
        if both:
            names = sorted(str(k) for k in self.frontends if k.key in both)
            raise ConfigError(f"a key may act as a frontend or as a peer engine, not both: {', '.join(names)} "
                              f"is in --frontend-keys and --peer-keys; give each process its own key")


def _refuse_own_key(own: KeyPair, listed: tuple[PublicKey, ...], flag: str, whose: str) -> None:
    """An engine's own public key on its allow-list would let whoever holds the engine's secret (a
    stolen engine key) act as that role here: a frontend one could stop the engine and push
    prefill compute anywhere. `kvseal keys generate --dir DIR` writes every public key into one
    folder, so naming that folder is the easy way to list it."""
    key = next((k for k in listed if k.key == own.public), None)
    if key is not None:
        raise ConfigError(f"{flag}: {key} is this engine's own public key (the pair of its --link-key); an engine "
                          f"never accepts its own key from a client. Give {flag} {whose} public keys only: their "
                          f"files, or a folder holding nothing else (not the folder `kvseal keys generate` wrote "
                          f"every key into)")


@dataclass(frozen=True)
class EngineEndpoint:
    """Where a frontend (or prefill) reaches an engine, and the public key that engine must prove."""

    address: str
    public_key: bytes


def load_key_pair(path: str | Path, flag: str = "--link-key") -> KeyPair:
    """A `NAME.key_secret` file; refused when it holds no secret key or others may read it."""
    path = Path(path)
    public, secret = _load_certificate(path, flag)
    if secret is None:
        raise ConfigError(f"{flag} {path} holds no secret key: give it the {SECRET_SUFFIX} file "
                          f"(`kvseal keys generate` writes NAME{PUBLIC_SUFFIX} and NAME{SECRET_SUFFIX})")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ConfigError(f"{flag} {path} is readable by other users (mode {mode:o}); a secret key must be "
                          f"readable by its owner only: chmod 600 {path}")
    return KeyPair(_key_name(path), public, secret)


def load_public_keys(spec: str, flag: str) -> tuple[PublicKey, ...]:
    """`PATH[,PATH...]`: public key files, or folders whose every `*.key` file counts."""
    keys: dict[bytes, PublicKey] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        path = Path(part)
        files = sorted(path.glob(f"*{PUBLIC_SUFFIX}")) if path.is_dir() else [path]
        if not files:
            raise ConfigError(f"{flag}: the folder {path} holds no *{PUBLIC_SUFFIX} file; {KEYS_HINT}")
        for file in files:
            key = PublicKey(_key_name(file), _load_certificate(file, flag)[0], file)
            keys.setdefault(key.key, key)
    if not keys:
        raise ConfigError(f"{flag} names no key file; {KEYS_HINT}")
    return tuple(keys.values())


def load_public_key_list(spec: str, flag: str) -> tuple[PublicKey, ...]:
    """`FILE[,FILE...]` in a given order (one per engine address), folders not allowed."""
    files = [Path(p.strip()) for p in spec.split(",") if p.strip()]
    for file in files:
        if file.is_dir():
            raise ConfigError(f"{flag} takes one public key file per engine, in the order of the addresses; "
                              f"{file} is a folder")
    return tuple(PublicKey(_key_name(f), _load_certificate(f, flag)[0], f) for f in files)


def _load_certificate(path: Path, flag: str) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise ConfigError(f"{flag}: no key file at {path}; {KEYS_HINT}")
    real = path.resolve()  # a link's target is what is read: its folder is the one that must be safe
    for checked in dict.fromkeys((path, path.absolute().parent, real, real.parent)):
        refuse_unsafe(checked, f"{flag}: {path}" if checked in (path, real) else f"{flag}: the folder of {path},",
                      KEY_STAKE)
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{flag}: {path} is not a key file written by `kvseal keys generate`: {exc}") from exc
    if public is None or len(public) != Z85_KEY_LEN:
        raise ConfigError(f"{flag}: {path} holds no public key; {KEYS_HINT}")
    return public, secret


def _key_name(path: Path) -> str:
    name = path.name
    for suffix in (SECRET_SUFFIX, PUBLIC_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def generate_keys(folder: str | Path, names: list[str]) -> list[tuple[Path, Path]]:
    """Write `NAME.key` and `NAME.key_secret` (0600) for each name into `folder` (made 0700 when
    it does not exist; refused when others may write it); never overwrites a key. The pair is
    made in a private temporary folder inside `folder` and moved into place, so the secret is
    never readable by others, not even for an instant. Returns the (public, secret) paths."""
    folder = Path(folder)
    for name in names:
        if not KEY_NAME.fullmatch(name):
            raise ConfigError(f"key name {name!r}: use letters, digits, '_', '.' or '-' (up to 64, "
                              f"starting with a letter or digit)")
    if len(set(names)) != len(names):
        raise ConfigError(f"a key name is given twice: {' '.join(names)}")
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot write keys to {folder}: {exc.strerror or exc} (give a folder, or a path "
                          f"where one can be made)") from exc
    refuse_unsafe(folder, "kvseal keys generate: the folder", KEY_STAKE)  # engines would refuse the keys in it
    taken = [p for n in names for p in (folder / f"{n}{PUBLIC_SUFFIX}", folder / f"{n}{SECRET_SUFFIX}") if p.exists()]
    if taken:
        raise ConfigError(f"{', '.join(map(str, taken))} exists already; keys are never overwritten (remove it "
                          f"first, and give the new public key to everyone who accepted the old one)")
    return [_generate_one(folder, name) for name in names]


def _generate_one(folder: Path, name: str) -> tuple[Path, Path]:
    with tempfile.TemporaryDirectory(dir=folder, prefix=".keys-") as private:  # mode 0700
        public_tmp, secret_tmp = (Path(p) for p in zmq.auth.create_certificates(private, name))
        os.chmod(secret_tmp, 0o600)
        os.chmod(public_tmp, 0o644)
        public, secret = folder / public_tmp.name, folder / secret_tmp.name
        try:
            os.link(secret_tmp, secret)  # fails rather than replace a file that appeared meanwhile
            os.link(public_tmp, public)
        except FileExistsError as exc:
            raise ConfigError(f"{exc.filename2 or exc.filename} appeared while it was written; not replaced") from exc
    return public, secret
