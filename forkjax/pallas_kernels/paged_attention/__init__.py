"""Paged attention kernels, decode and extend, ResidualAttention and unified: the public
functions are in api.py, which picks their backend (mosaic.py, triton.py, reference.py)."""
