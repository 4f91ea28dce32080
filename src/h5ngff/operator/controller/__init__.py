"""The controller room: the kopf operator and its pure decisions (see h5ngff.operator)."""
