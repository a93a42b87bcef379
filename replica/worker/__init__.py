"""One rank's work: its model shard, the decode graph runner, a step's packed inputs, the sampler."""
