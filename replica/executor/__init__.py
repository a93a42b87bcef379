"""The executor: the model runner over the ranks, tensor parallelism and its Ray placement bundles."""
