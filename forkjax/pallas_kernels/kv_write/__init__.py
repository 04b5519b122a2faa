"""A layer's K/V cache writes: the public functions are in api.py, which picks their backend
(mosaic.py, or the XLA scatters of `forkjax.cache.write_kv`)."""
