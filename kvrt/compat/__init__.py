"""Drop-ins for interfaces that engines' KV transfer code is already written against.

`kvrt.compat.vllm.KVLookupBuffer`: vLLM's `KVLookupBufferBase` (its `SimpleBuffer`).
"""
