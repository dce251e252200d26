"""The package's version: a leaf, so the API can name it without importing the package root."""

__version__ = "0.1.0"
