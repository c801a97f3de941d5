"""The ``hookscope`` command line: one module per subcommand over the products, plus model specs."""

from ._main import CLIError, main

__all__ = ["CLIError", "main"]
