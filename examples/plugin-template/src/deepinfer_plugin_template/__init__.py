"""deepinfer-plugin-template: two example DeepInfer feature plugins to copy.

* ``plugin.py`` (entry point ``template``): an op override, per engine (counts ``rms_norm`` calls).
* ``steer.py`` (entry point ``template_steer``): a logits processor steered per request through ``extra_args`` or
  per engine through an option.
"""

from deepinfer_plugin_template.plugin import OPTION, Counter, calls
from deepinfer_plugin_template.steer import Steer, parse_words

__all__ = ["OPTION", "Counter", "Steer", "calls", "parse_words"]
