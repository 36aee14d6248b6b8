"""`deepinfer plugins`, run as a user runs it, lists the installed template plugin as loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_deepinfer_plugins_lists_the_template():
    script = Path(sys.executable).parent / "deepinfer"
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_PLUGINS"}
    out = subprocess.run([str(script), "plugins", "--json"], check=True, capture_output=True, text=True, env=env)
    template = next(p for p in json.loads(out.stdout)["plugins"] if p["name"] == "template")
    assert template["status"] == "loaded", template["traceback"]
    assert template["distribution"] == "deepinfer-plugin-template"
    assert template["hook_api_version"] == 1
