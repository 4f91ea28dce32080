"""The write path: from a planned slab to committed chunks, the manifest and the output's metadata."""
