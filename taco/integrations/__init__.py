"""Compressed TP inside other frameworks: DTensor styles (torchtitan) and Megatron-Core patches.

    from taco.integrations.dtensor import TacoColwiseParallel, TacoRowwiseParallel, taco_plan
    import taco.integrations.megatron as tm; tm.enable(policy)   # or `with tm.compressed(policy):`

The submodules are imported on demand: `megatron` needs megatron-core (the `megatron` extra).
"""
