"""The models: GLM families (link, loss, their derivatives and kernel codes).

The lowest layer: it imports nothing else from the package.
"""
