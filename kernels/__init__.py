"""Triton kernels for paged and dp>1 KV layouts, each beside its plain-torch reference."""
