"""Offline benchmarks: random-weight preset checkpoints, the engine / HF runner, roofline estimates.

``deepinfer bench`` (``deepinfer_core.cli.bench``) is the command-line front end; the pieces:

* :mod:`deepinfer_core.bench.presets`: named model shapes written as real safetensors checkpoints;
* :mod:`deepinfer_core.bench.runner`: runs the engine (and optionally HF ``generate``) and measures;
* :mod:`deepinfer_core.bench.roofline`: the roofline floors and the peak numbers of known devices;
* :mod:`deepinfer_core.bench.report`: the printed table.
"""
