"""DeepInfer backend for Huawei Ascend 950 NPUs (torch_npu + CANN).

Importing this package never imports torch_npu. ``probe`` (the entry point) is cheap; ``backend`` and
``ops`` load torch_npu only when the backend is selected. Nothing here has been run on an Ascend 950 yet:
see docs/ascend950.md for what is implemented, what is tested on the CPU, and what is unverified.
"""

__version__ = "0.1.0"
