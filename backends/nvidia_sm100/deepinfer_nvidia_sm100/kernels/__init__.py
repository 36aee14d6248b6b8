"""Triton kernels of the NVIDIA backend. Imported only when the backend is selected (imports Triton)."""
