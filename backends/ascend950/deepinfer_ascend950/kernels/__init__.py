"""Custom Ascend 950 kernels: none yet. See README.md here for reusing TileLang sources on Ascend."""
