"""Gefen for distributed PyTorch: an AdamW drop-in with 0.5-1 byte of state per parameter."""

from .grad_check import check_gradients
from .integrations.register import register, register_loaded
from .memory_report import format_memory_report
from .method.segments import Segment
from .optimizer import Gefen

__all__ = ["Gefen", "Segment", "check_gradients", "format_memory_report", "register"]
__version__ = "0.1.0"

register_loaded()
