"""The Llama-family model on paged KV: ``llama`` (the forward pass), ``layers``
(tensor-parallel-shardable linears), ``rope`` (rotary embeddings), ``loader``
(checkpoint sources, tokenizer, weights). Imports torch and transformers; knows
nothing of requests or schedulers."""
