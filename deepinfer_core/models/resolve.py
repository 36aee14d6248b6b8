"""Find the checkpoint folder for a model argument: a local path, a cached hub id, or the default.

Resolution never downloads anything and never executes code shipped with a checkpoint.
"""

from __future__ import annotations

import importlib.resources
import os
import re
from pathlib import Path

from deepinfer_core import envs
from deepinfer_core.errors import DeepInferError

MODEL_DIR_ENV = "DEEPINFER_HF_MODEL_DIR"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


class ModelNotFoundError(DeepInferError, ValueError):
    """The model argument names no usable checkpoint folder; the message says how to get one."""


def resolve_model(model: str | os.PathLike | None = None) -> Path:
    """Return the checkpoint folder (holding config.json) for ``model``.

    * an existing local folder path is used as is;
    * ``None`` means ``$DEEPINFER_HF_MODEL_DIR`` when set, else the embedded default model
      (``deepinfer_core/assets/tiny_v4``);
    * a hub id ``"org/name"`` is looked up in the local Hugging Face cache (``$HF_HUB_CACHE``, else
      ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), preferring the snapshot ``refs/main`` points
      at, else the newest snapshot. Nothing is downloaded.

    Raises ModelNotFoundError saying how to download the model or set the environment variable.
    """
    if model is None:
        given = envs.DEEPINFER_HF_MODEL_DIR
        if given is not None:
            return _checked_folder(given, f"${MODEL_DIR_ENV}")
        return _checked_folder(default_model_dir(), "the embedded default model")
    path = Path(model).expanduser()
    if path.is_dir():
        return _checked_folder(path, "the model path")
    name = os.fspath(model)
    if _HUB_ID.match(name) and not name.startswith((".", "/", "~")):
        return _from_hub_cache(name)
    raise ModelNotFoundError(
        f"model {name!r} is neither an existing folder nor a hub id of the form 'org/name'. "
        f"Pass a checkpoint folder, a hub id already in the local Hugging Face cache, or set {MODEL_DIR_ENV}."
    )


def default_model_dir() -> Path:
    """The folder of the tiny default model shipped inside the package (may not exist yet)."""
    return Path(str(importlib.resources.files("deepinfer_core") / "assets" / "tiny_v4"))


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache folder, following ``HF_HUB_CACHE`` / ``HF_HOME`` like huggingface_hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def _from_hub_cache(hub_id: str) -> Path:
    cache = hub_cache_dir()
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    snapshot = _pick_snapshot(repo)
    if snapshot is None:
        raise ModelNotFoundError(
            f"model {hub_id!r} is not in the local Hugging Face cache ({cache}) and this engine never downloads. "
            f"Download it first with `hf download {hub_id}` (or `huggingface-cli download {hub_id}`), "
            f"or point {MODEL_DIR_ENV} / the model argument at a local checkpoint folder."
        )
    return _checked_folder(snapshot, f"the cached snapshot of {hub_id!r}")


def _pick_snapshot(repo: Path) -> Path | None:
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        pinned = snapshots / ref.read_text().strip()
        if pinned.is_dir():
            return pinned
    candidates = [p for p in snapshots.iterdir() if p.is_dir()] if snapshots.is_dir() else []
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)


def _checked_folder(folder: Path, what: str) -> Path:
    if not folder.is_dir():
        hint = (
            f"this install ships without it; pass a checkpoint folder or cached hub id, or set {MODEL_DIR_ENV}"
            if what == "the embedded default model"
            else "pass an existing checkpoint folder"
        )
        raise ModelNotFoundError(f"{what} folder {folder} does not exist; {hint}")
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(
            f"{what} folder {folder} has no config.json; a checkpoint folder needs config.json, tokenizer.json "
            "and *.safetensors (re-download the model or point at the right folder)"
        )
    return folder
