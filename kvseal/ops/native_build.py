"""Build and load the native kernels: `kvseal/ops/csrc/` compiled at first start for this CPU.

**Binding: cffi in API mode.** The declarations Python sees are `csrc/kvseal_ops.h` itself
(its preprocessor lines dropped, its `KVSEAL_` integer #defines kept), so there is no second
copy of a signature to fall out of step: every kernel source includes the header, a definition
that disagrees with its declaration does not compile, and cffi's generated wrapper calls each
function through that prototype (a wrong argument count or type from Python raises TypeError;
pointers are typed, so a bfloat16 tensor handed to a float32 kernel is refused). Chosen over
torch custom ops (`torch.utils.cpp_extension`): those compile C++ against torch's headers (tens
of seconds at first start, a C++ compiler and ninja), where the kernels are plain C with
OpenMP that need neither; the wrapper here is one small generated C file.

**Build.** `cc` compiles the wrapper and every `csrc/*.c` (in parallel) with `-O3 -march=native
-fopenmp` into a Python extension in the user's cache, `$XDG_CACHE_HOME/kvseal/native/<key>/`
(default `~/.cache`), about two seconds once per host; after that the cached file loads. The
key hashes every source file, the flags, the compiler's path and version (the first line of
`cc --version`), the CPU's feature flags (`-march=native` follows them) and the Python and
cffi versions, so a cache shared by several trees or hosts never serves another build. The
OpenMP runtime is torch's: `-fopenmp` links libgomp.so.1, the soname of the libgomp that torch
has already loaded, so the kernels' threads are torch's threads (torch is imported first).
The compiler is `$CC` if set, else `cc` (else `gcc`); `BuildConfig.describe()` says which and
why, and the engine logs it at start-up. A failed build raises `NativeBuildError` with the
compiler's own message.

**What the cache trusts.** Every kvseal process imports the built file, so whoever could write
it could run their own code in the server. It is held to the rule of key files (`owner_only`):
the folders from the cache's top down to the build's own are made 0700 where missing, and a
folder on the way or a built file that another user may change, or that is owned by neither
this user nor root, is not used: such a file is built again in its place, and where a folder
is like that the kernels are built into a private temporary folder of this process (again at
every start), with a warning naming the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType

import cffi
import torch  # noqa: F401  (loaded first: its libgomp is the one the kernels link)

from kvseal.owner_only import UnsafeFile, give_up_cache, make_owner_only_folders, refuse_unsafe

logger = logging.getLogger("kvseal")

CSRC = Path(__file__).resolve().parent / "csrc"
HEADER = "kvseal_ops.h"
OPTIMIZE = ("-O3", "-march=native", "-fopenmp")
# A Python extension whose only exported symbol is its PyInit (every kernel is hidden).
POSITION_INDEPENDENT = ("-fPIC", "-fvisibility=hidden")
# The kernel tests' sanitized build (`tests/ops`, marked `sanitizers`): ASan + UBSan, every
# finding fatal.
SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g")
_STDERR_TAIL = 6000  # characters of the compiler's message kept in an error
_STAKE = "run their own code in every kvseal process that loads the kernels"  # what `refuse_unsafe` guards


class NativeBuildError(RuntimeError):
    """The kernels could not be built or loaded; the message names the compiler and carries its
    own output."""


@dataclass(frozen=True)
class BuildConfig:
    """How the kernels are built: the compiler, its flags, the sources and the cache."""

    compiler: str
    compiler_origin: str  # where `compiler` came from, for the start-up log
    flags: tuple[str, ...] = OPTIMIZE
    csrc: Path = CSRC
    cache_root: Path = field(default_factory=lambda: _cache_home() / "kvseal" / "native")

    @classmethod
    def from_environment(cls) -> BuildConfig:
        """`$CC` if set, else the first of `cc`, `gcc` on PATH (`cc` when there is neither, so the
        error names it)."""
        chosen = os.environ.get("CC")
        if chosen:
            return cls(chosen, "$CC")
        found = shutil.which("cc") or shutil.which("gcc")
        return cls(found or "cc", "PATH" if found else "default (not on PATH)")

    def with_sanitizers(self) -> BuildConfig:
        return replace(self, flags=(*self.flags, *SANITIZE))

    def describe(self) -> str:
        return f"compiler {self.compiler} (from {self.compiler_origin}), flags {' '.join(self.flags)}, " \
               f"sources {self.csrc}"


@dataclass(frozen=True)
class BuiltLibrary:
    module: ModuleType  # cffi's extension: .ffi and .lib
    path: Path
    compiler_version: str
    build_s: float  # 0.0: loaded from the cache


def header_declarations(header_text: str) -> str:
    """The header as cffi's cdef: C declarations only (include guards and includes dropped),
    with its integer constants (`#define KVSEAL_NAME 2`) kept."""
    kept = []
    for line in header_text.splitlines():
        if not line.lstrip().startswith("#"):
            kept.append(line)
        elif re.match(r"#define KVSEAL_\w+ +-?\d+\b", line.strip()):
            kept.append(line.split("/*")[0].rstrip())
    return "\n".join(kept)


def build(config: BuildConfig) -> tuple[Path, str, float]:
    """Compile into the cache unless an identical build is there: (the extension's path, the
    compiler's version line, seconds spent building). Raises NativeBuildError."""
    version = compiler_version(config.compiler)
    sources = sorted(p for p in config.csrc.iterdir() if p.suffix in (".c", ".h"))
    key = _cache_key(config, version, sources)
    name = f"_kvseal_ops_{key}{sysconfig.get_config_var('EXT_SUFFIX')}"
    directory = _build_folder(config.cache_root, key)
    path = directory / name
    if path.exists():
        try:
            refuse_unsafe(path, "the built kernels", _STAKE)
            return path, version, 0.0
        except UnsafeFile as unsafe:  # never loaded: built again in its place (the folder is this user's alone)
            logger.warning("%s; they are built again", unsafe)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        built = Path(tmp) / path.name
        _compile(config, path.stem.split(".")[0], Path(tmp), built)
        os.chmod(built, stat.S_IMODE(built.stat().st_mode) & ~0o022)  # the linker wrote it with the umask's mode
        os.replace(built, path)  # atomic: a concurrent builder sees the whole file or none
    return path, version, time.perf_counter() - started


def load(config: BuildConfig) -> BuiltLibrary:
    """Build (or find in the cache) and import the kernels. Raises NativeBuildError."""
    path, version, seconds = build(config)
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    if spec is None or spec.loader is None:
        raise NativeBuildError(f"cannot load the built kernels {path}")
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as error:
        raise NativeBuildError(f"the built kernels {path} did not load: {error}") from error
    return BuiltLibrary(module, path, version, seconds)


_lock = threading.Lock()
_loaded: dict[BuildConfig, BuiltLibrary | NativeBuildError] = {}


def load_once(config: BuildConfig) -> BuiltLibrary:
    """`load`, once per process and configuration (a failure is remembered too)."""
    with _lock:
        if config not in _loaded:
            try:
                _loaded[config] = load(config)
            except NativeBuildError as error:
                _loaded[config] = error
        result = _loaded[config]
    if isinstance(result, NativeBuildError):
        raise result
    return result


def compiler_version(compiler: str) -> str:
    """The first line of `compiler --version`. Raises NativeBuildError naming the compiler when
    it is missing or does not run."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NativeBuildError(f"no usable C compiler: {compiler!r} did not run ({error}); install one (cc or "
                               f"gcc), or set $CC to it, or pass --native off for the torch ops") from error
    first = (done.stdout or done.stderr).strip().splitlines()
    if done.returncode != 0 or not first:
        raise NativeBuildError(f"{compiler} --version failed (exit {done.returncode}): {done.stderr.strip()}")
    return first[0]


def _compile(config: BuildConfig, module_name: str, tmp: Path, output: Path) -> None:
    """The generated wrapper and every kernel source, compiled in parallel (one process per file
    and CPU), then linked into `output`."""
    wrapper = tmp / f"{module_name}.c"
    _emit_wrapper(config, module_name, wrapper)
    includes = [f"-I{config.csrc}", *(f"-I{p}" for p in _python_includes())]
    sources = [wrapper, *sorted(config.csrc.glob("*.c"))]
    objects = [tmp / f"{source.stem}.o" for source in sources]
    commands = [[config.compiler, *config.flags, *POSITION_INDEPENDENT, *includes, "-c", str(source), "-o", str(obj)]
                for source, obj in zip(sources, objects)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        failures = [message for message in pool.map(_run, commands) if message]
    if failures:
        raise NativeBuildError(f"the kernels did not compile ({config.compiler}); the compiler said:\n"
                               + "\n".join(failures)[-_STDERR_TAIL:])
    message = _run([config.compiler, *config.flags, *POSITION_INDEPENDENT, "-shared", *(str(o) for o in objects),
                    "-o", str(output), "-lm"])
    if message:
        raise NativeBuildError(f"the kernels did not link ({config.compiler}); the linker said:\n"
                               + message[-_STDERR_TAIL:])


def _emit_wrapper(config: BuildConfig, module_name: str, wrapper: Path) -> None:
    """cffi's C wrapper: the header's declarations, each function called through them."""
    ffi = cffi.FFI()
    ffi.cdef(header_declarations((config.csrc / HEADER).read_text()))
    ffi.set_source(module_name, f'#include "{HEADER}"')
    with contextlib.redirect_stdout(io.StringIO()):  # cffi prints "generating <file>"
        ffi.emit_c_code(str(wrapper))


def _run(command: list[str]) -> str:
    """Run one compiler command; "" if it succeeded, else what it said (with the command)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{' '.join(command)}: did not run ({error})"
    return "" if done.returncode == 0 else f"$ {' '.join(command)}\n{done.stderr.strip()}"


def _python_includes() -> list[str]:
    paths = sysconfig.get_paths()
    return sorted({paths["include"], paths["platinclude"]})


def _cache_key(config: BuildConfig, version: str, sources: list[Path]) -> str:
    digest = hashlib.sha256()
    python = (sys.version.split()[0], sysconfig.get_config_var("EXT_SUFFIX") or "", cffi.__version__)
    for part in (*config.flags, *POSITION_INDEPENDENT, "-shared", config.compiler, version, _cpu_flags(), *python,
                 platform.machine()):
        digest.update(part.encode() + b"\0")
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _build_folder(cache_root: Path, key: str) -> Path:
    """The folder a build with `key` goes in: `cache_root / key`, the folders from the cache's top
    (`$XDG_CACHE_HOME` where `cache_root` is under it) down to it made 0700 where missing and
    checked (`owner_only`); where that fails, a folder in this process's private stand-in."""
    home = _cache_home()
    top = home if cache_root.is_relative_to(home) else cache_root
    try:
        make_owner_only_folders(top, cache_root / key, "the native kernels' cache folder", _STAKE)
        return cache_root / key
    except (OSError, UnsafeFile) as exc:
        folder = give_up_cache(cache_root, exc, "the native kernels' cache", "The kernels are built into",
                               "kvseal-native-") / key
        folder.mkdir(mode=0o700, exist_ok=True)
        return folder


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def _cpu_flags() -> str:
    """The CPU's feature flags (the build uses -march=native), so a shared cache never serves a
    library built for another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""
