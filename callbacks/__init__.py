"""Lightning callbacks of lightalign."""

from lightalign.callbacks.completions import CompletionSamples
from lightalign.callbacks.hf_export import HFExport
from lightalign.callbacks.throughput import TokenThroughput

__all__ = ["CompletionSamples", "HFExport", "TokenThroughput"]
