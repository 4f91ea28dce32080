"""The schema room: CRDs, admission rules, tenant policy, RBAC, and the status models (see h5ngff.operator)."""
