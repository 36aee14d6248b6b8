"""DeepInfer's NVIDIA backend (SM90 and SM100 paths).

Importing this package imports no CUDA extension and no Triton: ``probe`` only asks ``torch.cuda`` inside
the call. The backend class lives in ``deepinfer_nvidia_sm100.backend`` and the kernels in
``deepinfer_nvidia_sm100.kernels`` (imported only when the backend is selected).
"""

__version__ = "0.1.0"
