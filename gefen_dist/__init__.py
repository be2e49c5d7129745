"""Gefen for distributed PyTorch: an AdamW drop-in with ~1 byte of optimizer state per parameter."""

from .memory_report import format_memory_report
from .optimizer import Gefen
from .register import register, register_loaded
from .segments import Segment

__all__ = ["Gefen", "Segment", "format_memory_report", "register"]
__version__ = "0.1.0"

register_loaded()
