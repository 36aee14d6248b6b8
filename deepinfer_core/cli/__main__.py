"""``python -m deepinfer_core.cli ...``: the ``deepinfer`` console script without the script (torchrun runs this)."""

from deepinfer_core.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
