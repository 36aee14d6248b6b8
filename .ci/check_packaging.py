"""Packaging check (``tox -e packaging``): every distribution in this repository builds, installs from
one local wheel folder with the index off, its extras resolve, and its entry points work.

    python .ci/check_packaging.py WORKDIR

1. ``pip wheel --no-deps`` the root and every folder under backends/, plugins/, examples/ that has a
   pyproject.toml into WORKDIR/wheels; check the core wheel carries every file of deepinfer_core/assets/.
2. Fresh venv WORKDIR/venv: ``pip install torch==2.13.0`` first (CPU wheel from local disk), then the
   third-party runtime dependencies the wheels declare.
3. Only the core, from the wheel folder (``--no-index --find-links``): ``deepinfer env`` and
   ``deepinfer plugins`` must work, and the CPU backend must build its op table.
4. Every distribution, same way; each extra of each distribution must resolve (extras naming only our
   own distributions are installed with the index off; others are resolved with ``--dry-run``).
5. ``deepinfer plugins --json`` lists every ``deepinfer.plugins`` entry point as loaded, and
   ``deepinfer env --json`` lists every ``deepinfer.backends`` entry point.
"""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sh(*cmd: str | Path, capture: bool = False) -> str:
    """Run ``cmd``, echoing it; raise on failure."""
    print("+", " ".join(map(str, cmd)), flush=True)
    result = subprocess.run([str(c) for c in cmd], check=False, text=True, capture_output=capture)
    if result.returncode != 0:
        detail = f"\n{result.stdout}\n{result.stderr}" if capture else ""
        raise SystemExit(f"packaging check failed: {' '.join(map(str, cmd))} exited {result.returncode}{detail}")
    return result.stdout if capture else ""


def distribution_dirs() -> list[Path]:
    """The root plus every backends/*, plugins/*, examples/* folder with a pyproject.toml."""
    found = [ROOT]
    for parent in ("backends", "plugins", "examples"):
        found += sorted(p.parent for p in (ROOT / parent).glob("*/pyproject.toml"))
    return found


class Wheel:
    """What a built wheel declares: name, requirements (per extra), entry points, files."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with zipfile.ZipFile(path) as zf:
            self.files = zf.namelist()
            info = next(n for n in self.files if n.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
            meta = Parser().parsestr(zf.read(f"{info}/METADATA").decode())
            eps = configparser.ConfigParser(delimiters=("=",))
            eps.optionxform = str  # keep entry-point names as written
            if f"{info}/entry_points.txt" in self.files:
                eps.read_string(zf.read(f"{info}/entry_points.txt").decode())
        self.name = canonical(meta["Name"])
        self.extras = meta.get_all("Provides-Extra") or []
        self.requires = meta.get_all("Requires-Dist") or []
        self.entry_points = {group: dict(eps[group]) for group in eps.sections()}

    def requirements(self, extra: str | None = None) -> list[str]:
        """Requirement strings without markers: the base ones, or those of ``extra``."""
        out = []
        for req in self.requires:
            spec, _, marker = req.partition(";")
            tagged = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
            if (tagged.group(1) if tagged else None) == extra:
                out.append(spec.strip())
        return out


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return canonical(re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0])


def check_assets(core: Wheel) -> None:
    assets = ROOT / "deepinfer_core" / "assets"
    expected = {
        p.relative_to(ROOT).as_posix() for p in assets.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    missing = sorted(expected - set(core.files))
    if missing:
        raise SystemExit(f"packaging check failed: the core wheel lacks asset files: {missing}")
    print(f"core wheel carries all {len(expected)} asset file(s)")


def main(workdir: str) -> int:
    work = Path(workdir).resolve()
    wheels_dir, env_dir = work / "wheels", work / "venv"
    shutil.rmtree(wheels_dir, ignore_errors=True)
    shutil.rmtree(env_dir, ignore_errors=True)
    for dist_dir in distribution_dirs():
        sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels_dir, dist_dir)
    wheels = {w.name: w for w in map(Wheel, sorted(wheels_dir.glob("*.whl")))}
    ours = set(wheels)
    print("built:", ", ".join(sorted(ours)))
    check_assets(wheels["deepinfer"])

    venv.create(env_dir, with_pip=True)
    py, bin_dir = env_dir / "bin" / "python", env_dir / "bin"
    sh(py, "-m", "pip", "install", "-q", "torch==2.13.0")
    third_party = sorted({r for w in wheels.values() for r in w.requirements() if requirement_name(r) not in ours})
    sh(py, "-m", "pip", "install", "-q", *third_party)
    local = ("--no-index", "--find-links", wheels_dir)

    sh(py, "-m", "pip", "install", "-q", *local, "deepinfer")
    sh(bin_dir / "deepinfer", "env")
    sh(bin_dir / "deepinfer", "plugins")
    # The core alone must run its CPU backend: catches a runtime import the dependencies do not cover.
    sh(py, "-c", "from deepinfer_core.backends.cpu import CpuBackend; CpuBackend().make_op_table()")

    sh(py, "-m", "pip", "install", "-q", *local, *sorted(ours))
    for wheel in wheels.values():
        for extra in wheel.extras:
            target = f"{wheel.name}[{extra}]"
            siblings = {
                requirement_name(r) for r in wheel.requirements(extra) if requirement_name(r).startswith("deepinfer")
            }
            if siblings - ours:
                raise SystemExit(
                    f"packaging check failed: extra {target} names {', '.join(sorted(siblings - ours))}, which no "
                    "folder of this repository builds; add the extra only together with its distribution"
                )
            if all(requirement_name(r) in ours for r in wheel.requirements(extra)):
                sh(py, "-m", "pip", "install", "-q", *local, target)
            else:
                sh(py, "-m", "pip", "install", "-q", "--dry-run", "--find-links", wheels_dir, target)

    plugins = json.loads(sh(bin_dir / "deepinfer", "plugins", "--json", capture=True))["plugins"]
    status = {p["name"]: p["status"] for p in plugins}
    backends = {b["name"] for b in json.loads(sh(bin_dir / "deepinfer", "env", "--json", capture=True))["backends"]}
    for wheel in wheels.values():
        for name in wheel.entry_points.get("deepinfer.plugins", {}):
            if status.get(name) != "loaded":
                raise SystemExit(f"packaging check failed: plugin {name!r} of {wheel.name} is {status.get(name)}")
        for name in wheel.entry_points.get("deepinfer.backends", {}):
            if name not in backends:
                raise SystemExit(f"packaging check failed: backend {name!r} of {wheel.name} is not listed")
    print("deepinfer plugins:", ", ".join(f"{n}={s}" for n, s in sorted(status.items())))
    print("packaging check passed:", len(wheels), "distribution(s)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    raise SystemExit(main(sys.argv[1]))
