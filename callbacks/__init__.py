"""Lightning callbacks of lightalign."""

from lightalign.callbacks.completions import CompletionSamples
from lightalign.callbacks.device_cache import DeviceCacheCleanup
from lightalign.callbacks.hf_export import HFExport
from lightalign.callbacks.hub_push import HubPush
from lightalign.callbacks.nonfinite import NonFiniteGuard
from lightalign.callbacks.plot import PlotCurves
from lightalign.callbacks.progress import StepProgressBar
from lightalign.callbacks.run_checkpoint import RunCheckpoint
from lightalign.callbacks.run_config import RunVersions, SaveRunConfig
from lightalign.callbacks.run_folder import RunFolder
from lightalign.callbacks.summary import RunSummary
from lightalign.callbacks.throughput import TokenThroughput

__all__ = ["CompletionSamples", "DeviceCacheCleanup", "HFExport", "HubPush", "NonFiniteGuard", "PlotCurves", "RunCheckpoint",
           "RunFolder", "RunSummary", "RunVersions", "SaveRunConfig", "StepProgressBar", "TokenThroughput"]
