"""Lightning callbacks of lightalign."""

from lightalign.callbacks.completions import CompletionSamples
from lightalign.callbacks.device_cache import DeviceCacheCleanup
from lightalign.callbacks.hf_export import HFExport
from lightalign.callbacks.throughput import TokenThroughput

__all__ = ["CompletionSamples", "DeviceCacheCleanup", "HFExport", "TokenThroughput"]
