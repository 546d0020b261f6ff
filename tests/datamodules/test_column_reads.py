"""The data modules read a tokenized column whole (``dataset["input_ids"][:]``), not one formatted row per element:
on a cached 200,000-row file that row-by-row read was about a third of the data module's setup."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("layout", [{"packing": True}, {"group_by_length": True}])
def test_sft_setup_reads_tokenized_columns_whole_not_row_by_row(tiny_dir, monkeypatch, layout):
    """A column of a ``Dataset`` (``dataset["input_ids"]``) is read one formatted row per element when iterated or
    indexed; the SFT data module reads each column it needs whole, so preparing 96 rows formats a handful of single
    rows (the first row's format check), not one per row. Mutations: ``tokenized["completion_mask"]`` without
    ``[:]`` in ``prepare_rows`` (both), or ``tokenized["input_ids"]`` without it in ``_pack`` (packing) or
    ``make_epoch_sampler`` (group_by_length) -> 96+ single rows formatted."""
    from datasets import Dataset
    from datasets.formatting.formatting import PythonFormatter

    from lightalign.datamodules.sft import SFTDataModule

    rows = Dataset.from_dict({"prompt": [f"{i} + {i} =" for i in range(96)],
                              "completion": [f" {2 * i}" for i in range(96)]})
    single_rows = []
    format_row = PythonFormatter.format_row
    monkeypatch.setattr(PythonFormatter, "format_row", lambda self, table: single_rows.append(1) or format_row(self, table))
    dm = SFTDataModule(rows, tokenizer=str(tiny_dir), batch_size=4, max_length=16, **layout)
    dm.setup("fit")
    dm.make_epoch_sampler()
    assert len(single_rows) <= 4, len(single_rows)
