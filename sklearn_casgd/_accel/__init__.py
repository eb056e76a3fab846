"""Accelerators the engine may use: ``torch.compile`` and its cache, Triton kernels.

Below the engine: these modules know the families (for the kernels' loss
codes) and nothing above them; the engine decides when they run.
"""
