"""The cluster's conda environment (envs/gnnpipe.yaml) installs what the tested lock does: every
runtime dependency of pyproject.toml pinned, each pin the lock's version (a package added to the
package but not to the environment fails on the cluster only, at its first import)."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_conda_env_pins_every_dependency_at_the_locks_version():
    lock = dict(line.split("==", 1) for line in (ROOT / "requirements/cpu.lock.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    lock = {_name(k): v.strip() for k, v in lock.items()}
    env = yaml.safe_load((ROOT / "envs/gnnpipe.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    pins = {_name(p): p.split("==", 1)[1] for p in pip if "==" in p}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    missing = {_name(d) for d in deps} - set(pins)
    assert not missing, f"envs/gnnpipe.yaml does not pin {sorted(missing)}"
    assert {k: v for k, v in pins.items() if lock.get(k) != v} == {}
