"""``sparsify`` / ``densify`` for existing Flax NNX models and Linen variables."""
