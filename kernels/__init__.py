"""Triton kernels, installed as ``zero_kernels.kernels`` (never as a top-level ``kernels``).

    adam.py     the fused Adam/AdamW step over a table of tensors (flat shards are a table of one)
    flatten.py  bucket flatten (gather + cast + scale) and unflatten (scatter) kernels
"""
