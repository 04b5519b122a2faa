"""The device side of the engine: the one owner of everything that lives on the device.

`ModelRunner` (model_runner.py) holds the parameters, the KV pools (kv_pools.py), the host tier's
blocks (host_blocks.py) and the compiled step programs (step_program.py, compiler.py); it turns
a scheduled batch, plain host data from the scheduler, into one dispatched step. Nothing else
writes device state: the cache (forkjax.cache) is host bookkeeping and hands its copies over as
plain data.
"""
