"""colibri: run Mixture-of-Experts language models on ordinary CPUs, from one mmap'd file."""
from .errors import ColibriError, ColibriFormatError

__version__ = "0.1.0"

__all__ = ["ColibriError", "ColibriFormatError", "__version__"]
