"""Lightning callbacks of lightalign."""

from lightalign.callbacks.hf_export import HFExport
from lightalign.callbacks.throughput import TokenThroughput

__all__ = ["HFExport", "TokenThroughput"]
