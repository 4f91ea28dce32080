"""h5ngff's benchmark suite: the physical limit, h5ngff and its peers on the same input, output
chunks and codec, in one run, with every output verified. ``python -m bench --help``."""
