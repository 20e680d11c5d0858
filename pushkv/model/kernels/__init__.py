"""GPU kernels of the model (Triton), and their torch references.

Only ``pushkv.model`` imports this package. ``paged`` is the device-neutral entry:
it runs the Triton kernels on CUDA tensors and the torch reference elsewhere, so the
batched forward is the same code on both and CI (CPU) exercises everything but the
kernels themselves.
"""
