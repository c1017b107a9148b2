"""constraints.txt (the lock the README installs with) and pyproject.toml name the same direct
dependencies, and every pinned version satisfies pyproject's range."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DIRECT = "kvseal (pyproject.toml)"


def _pyproject_requirements(text: str) -> dict[str, Requirement]:
    project = tomllib.loads(text)["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs.extend(extra)
    requirements = [Requirement(spec) for spec in specs]
    return {canonicalize_name(r.name): r for r in requirements}


def _lock_entries(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (pinned version, the `# via` names) for every `name==version` entry."""
    entries: dict[str, tuple[str, list[str]]] = {}
    current = ""
    for line in text.splitlines():
        pin = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line.strip())
        if pin and not line.startswith(" "):
            current = canonicalize_name(pin.group(1))
            entries[current] = (pin.group(2), [])
        elif current and line.startswith("    # via"):
            via = line.removeprefix("    # via").strip()
            entries[current][1].extend([via] if via else [])
        elif current and line.startswith("    #   "):
            entries[current][1].append(line.removeprefix("    #   ").strip())
    return entries


def disagreements(pyproject_text: str, lock_text: str) -> list[str]:
    """What a reader must fix so that the lock is pyproject's resolution; empty when they agree."""
    wanted = _pyproject_requirements(pyproject_text)
    locked = _lock_entries(lock_text)
    problems = [f"{name} is in pyproject.toml, not in the lock" for name in sorted(set(wanted) - set(locked))]
    direct = {name for name, (_, via) in locked.items() if DIRECT in via}
    problems += [f"{name} is locked as a direct dependency, not in pyproject.toml"
                 for name in sorted(direct - set(wanted))]
    for name in sorted(set(wanted) & set(locked)):
        version = locked[name][0]
        if not wanted[name].specifier.contains(version, prereleases=True):
            problems.append(f"{name}=={version} in the lock is outside pyproject's {wanted[name].specifier}")
    return problems


def test_lock_agrees_with_pyproject() -> None:
    problems = disagreements((ROOT / "pyproject.toml").read_text(), (ROOT / "constraints.txt").read_text())
    assert problems == [], "run `bash tools/refresh_lock.sh`: " + "; ".join(problems)


def test_a_dependency_added_to_one_side_only_is_caught() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    lock = (ROOT / "constraints.txt").read_text()
    grown = pyproject.replace('dependencies = [\n', 'dependencies = [\n    "leftpad-nowhere>=1",\n', 1)
    assert disagreements(grown, lock) == ["leftpad-nowhere is in pyproject.toml, not in the lock"]
    stray = lock + "stray-package==1.0\n    # via kvseal (pyproject.toml)\n"
    assert disagreements(pyproject, stray) == ["stray-package is locked as a direct dependency, not in pyproject.toml"]
    narrowed = pyproject.replace('"msgspec"', '"msgspec<0.1"', 1)
    assert any(p.startswith("msgspec==") for p in disagreements(narrowed, lock))


def test_readme_commands_install_from_the_lock() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(pip install torch==2\.13\.0 [^\n]+)\n```", readme)[:2]
    assert len(commands) == 2 and all("pip install -c constraints.txt -e " in c for c in commands)
