"""Datasets, the multi-task datamodule, collation and bundled-dataset preparation."""
