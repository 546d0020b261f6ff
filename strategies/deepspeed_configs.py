"""DeepSpeed ZeRO configs for Lightning's ``DeepSpeedStrategy`` (ZeRO-1, 2, 3, with or without CPU offload).

Lightning owns batch size, accumulation, clipping and precision, so these hold only the ZeRO part; the JSON
files in ``configs/strategies/`` are these dicts written out (``python -m lightalign.strategies.deepspeed_configs``
rewrites them) and are validated by DeepSpeed's own config parser in the tests.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any


def deepspeed_config(stage: int, offload: bool = False, **overrides: Any) -> dict[str, Any]:
    """The ZeRO section for ``stage`` (1-3); ``offload`` moves optimizer state (and, at stage 3, parameters) to CPU."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}.")
    if offload and stage == 1:
        raise ValueError("ZeRO offload needs stage 2 or 3.")
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 2:
        zero.update(overlap_comm=True, contiguous_gradients=True, reduce_scatter=True,
                    allgather_bucket_size=200_000_000, reduce_bucket_size=200_000_000)
    if stage == 3:
        # gather the full 16-bit weights when saving, so a checkpoint can be turned into one HF folder
        zero.update(stage3_gather_16bit_weights_on_model_save=True, stage3_prefetch_bucket_size=50_000_000,
                    stage3_param_persistence_threshold=100_000, sub_group_size=1_000_000_000)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {"zero_optimization": zero, "zero_allow_untested_optimizer": True}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return copy.deepcopy(config)


SHIPPED = {
    "deepspeed_zero1": (1, False), "deepspeed_zero2": (2, False), "deepspeed_zero3": (3, False),
    "deepspeed_zero2_offload": (2, True), "deepspeed_zero3_offload": (3, True),
}


def write_shipped(folder: str | Path) -> list[Path]:
    """Write ``<folder>/<preset>.json`` (DeepSpeed's format) and ``<folder>/<preset>.yaml`` (a
    ``--trainer.strategy`` file naming ``DeepSpeedZeroStrategy`` with the same config inline) for every preset."""
    import yaml

    paths = []
    for name, (stage, offload) in SHIPPED.items():
        config = deepspeed_config(stage, offload)
        path = Path(folder) / f"{name}.json"
        path.write_text(json.dumps(config, indent=2) + "\n")
        strategy = {"class_path": "lightalign.strategies.DeepSpeedZeroStrategy", "init_args": {"config": config}}
        header = f"# {name}: lightalign fit --config <method>.yaml --trainer.strategy configs/strategies/{name}.yaml\n"
        header += "# (needs CUDA GPUs and pip install 'lightalign[deepspeed]'; written by strategies/deepspeed_configs.py)\n"
        yaml_path = Path(folder) / f"{name}.yaml"
        yaml_path.write_text(header + yaml.safe_dump(strategy, sort_keys=False))
        paths += [path, yaml_path]
    return paths


if __name__ == "__main__":
    for written in write_shipped(Path(__file__).resolve().parent.parent / "configs" / "strategies"):
        print(written)
