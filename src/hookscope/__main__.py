"""``python -m hookscope`` runs the command-line tool (also under ``torchrun``)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
