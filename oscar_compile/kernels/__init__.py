"""Triton kernels for the oscar ops, each beside its plain-PyTorch reference."""
