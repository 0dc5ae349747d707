"""`shardlib train`: the run loop (setup, steps with periodic actions, finish) and its outputs."""
