"""Model building blocks: batch-invariant linear layers, paged attention, rotary, norms, embeddings."""
