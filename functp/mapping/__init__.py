"""shard_map and moving data between layouts: shard, unshard, reshard, remat."""
