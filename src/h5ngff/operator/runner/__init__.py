"""The runner room: the runner pod's program, ``h5ngff runner`` (see h5ngff.operator)."""
