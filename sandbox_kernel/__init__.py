"""sandbox-kernel: a Jupyter kernel whose cells run in an isolated sandbox."""

__version__ = "0.1.0"
