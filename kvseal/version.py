"""kvseal's version (its own module: the frontend reports it without importing the package's API)."""

__version__ = "0.1.0"
