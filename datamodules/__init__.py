"""LightningDataModules: rows in TRL's formats -> validated, tokenized, collated batches."""

from lightalign.datamodules.collators import PaddingCollator, PaddingFreeCollator
from lightalign.datamodules.formats import DataFormatError
from lightalign.datamodules.prompt import PromptCollator, PromptDataModule
from lightalign.datamodules.preference import PreferenceCollator, PreferenceDataModule
from lightalign.datamodules.sft import SFTDataModule
from lightalign.datamodules.unpaired import UnpairedPreferenceCollator, UnpairedPreferenceDataModule

__all__ = [
    "DataFormatError", "PaddingCollator", "PaddingFreeCollator", "PreferenceCollator", "PreferenceDataModule", "PromptCollator",
    "PromptDataModule",
    "SFTDataModule", "UnpairedPreferenceCollator", "UnpairedPreferenceDataModule",
]
