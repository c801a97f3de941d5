"""The package version, in a module of its own so every layer can name it without importing the
public namespace."""

__all__ = ["__version__"]

__version__ = "0.1.0"
