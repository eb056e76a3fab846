"""A rank's rows of X as the engine touches them (dense tensors or CSR).

Below the engine: it imports nothing else from the package.
"""
