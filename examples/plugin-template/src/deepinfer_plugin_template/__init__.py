"""deepinfer-plugin-template: an example DeepInfer feature plugin (see ``plugin.py``)."""

from deepinfer_plugin_template.plugin import OPTION, calls, reset

__all__ = ["OPTION", "calls", "reset"]
