"""Ready-made hookups of flashflow's ops into other libraries' models.

``flashflow.integrations.diffusers``: ``enable(transformer)`` / ``disable(transformer)`` for
diffusers' Qwen-Image transformer (docs/diffusion.md).
``flashflow.integrations.cfg_parallel``: ``enable_cfg_parallel(pipe, group)`` runs the two
passes of a true-CFG step of a Qwen-Image pipeline on two ranks (docs/distributed.md). Each integration imports its library
itself, so ``import flashflow`` never needs diffusers installed.
"""
