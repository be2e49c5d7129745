"""Gefen for distributed PyTorch: an AdamW drop-in with ~1 byte of optimizer state per parameter."""

from .optimizer import Gefen, format_memory_report
from .segments import Segment

__all__ = ["Gefen", "Segment", "format_memory_report"]
__version__ = "0.1.0"
