# Source from the repository root on a machine where this repo's packages are not installed (the lent GPU
# machine: no package index, no hatchling). Writes dist-info folders for the core, the NVIDIA backend and every
# plugin under plugins/, with the entry points their pyproject.toml files declare, and puts them and the
# sources on PYTHONPATH, so backends and plugins are found as if installed. /tmp/site (wheels unpacked
# there beforehand: TileLang, transformers) goes first when present.
GPU_SITE=${GPU_SITE:-/tmp/site-di}
python3 - "$GPU_SITE" <<'PY'
import sys, tomllib
from pathlib import Path

site = Path(sys.argv[1])
for folder in [".", "backends/nvidia_sm100"] + sorted(str(p.parent) for p in Path("plugins").glob("*/pyproject.toml")):
    project = tomllib.loads(Path(folder, "pyproject.toml").read_text())["project"]
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = project.get("entry-points", {})
    (info / "entry_points.txt").write_text(
        "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for group, eps in groups.items()))
PY
GPU_SITE_SOURCES=$PWD:$PWD/backends/nvidia_sm100
for src in "$PWD"/plugins/*/src; do GPU_SITE_SOURCES=$GPU_SITE_SOURCES:$src; done
export PYTHONPATH=/tmp/site:$GPU_SITE:$GPU_SITE_SOURCES${PYTHONPATH:+:$PYTHONPATH}
