"""Triton kernels, installed as ``zero_kernels.kernels`` (never as a top-level ``kernels``).

    adam.py     the fused Adam/AdamW step over a table of tensors (flat shards are a table of one)
    adam_coded.py  the same step on coded (bf16 / 8-bit / fp8 / remainder) states, codecs in _codecs.py
    flatten.py  bucket flatten (gather + cast + scale) and unflatten (scatter) kernels
"""
