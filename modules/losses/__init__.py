"""The losses as pure functions of tensors (or small configured objects), one file per family of objectives: no
model, no data, no Lightning."""
