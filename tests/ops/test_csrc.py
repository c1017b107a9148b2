"""The kernels' C sources (`kvseal/ops/csrc/`) as CI checks them: formatted by the repository's
.clang-format; compiled with -Wall -Wextra -Werror for every ISA family the code branches on,
whether or not this host can run it, each family taking its own branches; and the binding checked
by the build: a declaration in the one header that disagrees with its definition (an argument's
type, their count) fails the build with the compiler's own message, and Python sees exactly the
header's functions."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from built_kernels import BUILD, KERNELS

from kvseal.ops.native_build import CSRC, HEADER, BuildConfig, NativeBuildError, build, header_declarations

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(CSRC.glob("*.c"))
# -march -> the isa.h macros it must set to 1 (every other KVSEAL_ ISA macro 0)
ISA_FAMILIES = {
    "x86-64-v3": {"KVSEAL_AVX2"},
    "skylake-avx512": {"KVSEAL_AVX2", "KVSEAL_AVX512F", "KVSEAL_AVX512BW"},
    "cooperlake": {"KVSEAL_AVX2", "KVSEAL_AVX512F", "KVSEAL_AVX512BW", "KVSEAL_AVX512BF16"},
    "sapphirerapids": {"KVSEAL_AVX2", "KVSEAL_AVX512F", "KVSEAL_AVX512BW", "KVSEAL_AVX512BF16", "KVSEAL_AMX"},
}
WARNINGS = ("-Wall", "-Wextra", "-Werror")


def _compiler() -> str:
    compiler = shutil.which(BuildConfig.from_environment().compiler)
    if compiler is None:
        pytest.skip("no C compiler")
    return compiler


def test_the_sources_are_formatted_by_the_repositorys_clang_format() -> None:
    clang_format = shutil.which("clang-format")
    if clang_format is None:
        pytest.skip("clang-format is not installed (pip install -e '.[test]' installs it)")
    files = sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".h"))
    done = subprocess.run([clang_format, "--dry-run", "--Werror", f"--style=file:{ROOT / '.clang-format'}",
                           *map(str, files)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"run `clang-format -i kvseal/ops/csrc/*.[ch]`:\n{done.stderr[-4000:]}"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the ISA families are x86-64's")
def test_every_isa_family_compiles_without_a_warning(tmp_path: Path) -> None:
    """Each -march compiles every source with -Wall -Wextra -Werror (`-c`, nothing run), and
    isa.h turns on exactly that family's branches."""
    compiler = _compiler()

    def family(march: str) -> str:
        out = tmp_path / march
        out.mkdir()
        flags = [f"-march={march}", "-O3", "-fopenmp", *WARNINGS]
        macros = subprocess.run([compiler, *flags, "-dM", "-E", str(CSRC / "isa.h")], capture_output=True,
                                text=True, timeout=120)
        if macros.returncode != 0:
            return f"{march}: the compiler does not take it: {macros.stderr.strip()}"
        on = set(re.findall(r"#define (KVSEAL_\w+) 1\b", macros.stdout))
        if on != ISA_FAMILIES[march]:
            return f"{march}: isa.h turns on {sorted(on)}, expected {sorted(ISA_FAMILIES[march])}"
        done = subprocess.run([compiler, *flags, "-c", *map(str, SOURCES)], cwd=out, capture_output=True, text=True,
                              timeout=600)
        return "" if done.returncode == 0 else f"{march}:\n{done.stderr[-4000:]}"

    with ThreadPoolExecutor(max_workers=len(ISA_FAMILIES)) as pool:
        failures = [message for message in pool.map(family, ISA_FAMILIES) if message]
    assert not failures, "\n".join(failures)


def _header_with(tmp_path: Path, old: str, new: str) -> BuildConfig:
    """A copy of the sources whose header has `old` replaced by `new`, built at -O0 into tmp_path."""
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    header = (csrc / HEADER).read_text()
    assert header.count(old) == 1, f"{old!r} is not once in the header"
    (csrc / HEADER).write_text(header.replace(old, new))
    return replace(BUILD, flags=("-O0", "-fopenmp"), csrc=csrc, cache_root=tmp_path / "cache")


@pytest.mark.parametrize("old, new", [
    # an argument's type (an int64 count declared int32)
    ("void kvseal_argmax_rows(const float *x, int64_t rows,", "void kvseal_argmax_rows(const float *x, int32_t rows,"),
    # a pointer's element type
    ("void kvseal_silu_mul(const float *gate_up,", "void kvseal_silu_mul(const double *gate_up,"),
    # the count: an argument left out
    ("int kvseal_tiles_engine(int engine);", "int kvseal_tiles_engine(void);"),
])
def test_a_declaration_that_disagrees_with_its_definition_fails_the_build(tmp_path: Path, old: str, new: str) -> None:
    _compiler()
    name = re.search(r"(kvseal_\w+)\(", old).group(1)  # type: ignore[union-attr]
    with pytest.raises(NativeBuildError) as failed:
        build(_header_with(tmp_path, old, new))
    message = str(failed.value)
    assert "did not compile" in message and "the compiler said" in message
    assert re.search(rf"(conflicting types for|too many arguments to function) .{name}", message), message


def test_the_unchanged_sources_build_at_O0(tmp_path: Path) -> None:
    """The same copy without a change builds (the failures above are the change's)."""
    _compiler()
    path, version, _ = build(_header_with(tmp_path, "#define KVSEAL_OPS_H", "#define KVSEAL_OPS_H"))
    assert path.exists() and version


def test_python_sees_exactly_the_headers_functions() -> None:
    if KERNELS is None:
        pytest.skip("no C compiler: the native kernels are not built")
    declared = set(re.findall(r"\b(kvseal_\w+)\(", header_declarations((CSRC / HEADER).read_text())))
    exposed = {name for name in dir(KERNELS.lib) if name.startswith("kvseal_")}
    assert exposed == declared
    defined = {m for source in SOURCES for m in re.findall(r"^\w[\w ]* \*?(kvseal_\w+)\(", source.read_text(), re.M)}
    assert declared <= defined | {"kvseal_linear_f32", "kvseal_linear_bf16", "kvseal_pack_panels_f32",
                                  "kvseal_pack_panels_bf16"}  # those four from linear_panels_typed.h
