"""Ready-made hookups of flashflow's ops into other libraries' models.

``flashflow.integrations.diffusers``: ``enable(transformer)`` / ``disable(transformer)`` for
diffusers' Qwen-Image transformer (docs/diffusion.md). Each integration imports its library
itself, so ``import flashflow`` never needs diffusers installed.
"""
