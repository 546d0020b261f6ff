"""LightningDataModules: rows in TRL's formats -> validated, tokenized, collated batches."""

from lightalign._lazy import lazy_attributes

_EXPORTS = {
    **dict.fromkeys(["PaddingCollator", "PaddingFreeCollator"], "lightalign.datamodules.collators"),
    "DataFormatError": "lightalign.datamodules.formats",
    **dict.fromkeys(["PromptCollator", "PromptDataModule"], "lightalign.datamodules.prompt"),
    **dict.fromkeys(["PreferenceCollator", "PreferenceDataModule"], "lightalign.datamodules.preference"),
    "SFTDataModule": "lightalign.datamodules.sft",
    **dict.fromkeys(["TriplePreferenceCollator", "TriplePreferenceDataModule"], "lightalign.datamodules.triple_preference"),
    **dict.fromkeys(["UnpairedPreferenceCollator", "UnpairedPreferenceDataModule"], "lightalign.datamodules.unpaired"),
}
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)

__all__ = [
    "DataFormatError", "PaddingCollator", "PaddingFreeCollator", "PreferenceCollator", "PreferenceDataModule", "PromptCollator",
    "PromptDataModule",
    "SFTDataModule", "UnpairedPreferenceCollator", "UnpairedPreferenceDataModule",
    "TriplePreferenceCollator", "TriplePreferenceDataModule",
]
