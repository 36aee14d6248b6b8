"""Kernels of the NVIDIA backend (Triton; TileLang in tl_attention.py). Imported only when the backend is selected."""
