"""shard_map (its boundary: vma or sum rules) and moving data between layouts: shard,
unshard, reshard; parameters swapped into a module."""
