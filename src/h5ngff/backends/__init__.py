"""Where the workers run: local LocalCluster (optionally under cgroup pod limits), an existing
scheduler, or Kubernetes.

A regular package (not a namespace one) so import-linter sees its modules; see tests/test_architecture.py.
"""
