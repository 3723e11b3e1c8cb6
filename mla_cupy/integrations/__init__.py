"""Glue for frameworks that pick attention kernels by name (import the submodule you need:
:mod:`mla_cupy.integrations.transformers`). Importing this package imports no framework."""
