"""The Kubernetes side of h5ngff, in three rooms by role (docs/architecture.md, "The operator's
rooms"), kept apart by import contracts (pyproject.toml's [tool.importlinter]):

* ``controller``: the kopf operator. Thin kopf handlers (``handlers``, ``guard``), one pass per
  kind without kopf (``jobpass``, ``batchpass``), the pure decisions (``reconcile``,
  ``batchreconcile``, on the shared ``toolkit``), the output Leases (``lease``) and the pure
  builders of what it creates (``manifests``). It imports nothing that converts: no Dask, zarr,
  h5py, engine or backends.
* ``schema``: what the API server and the tenant policy admit (``crd``, ``admission``,
  ``policy``, ``rbac``) and the models of the two resources' specs and statuses.
* ``runner``: the runner pod's program (``h5ngff runner``): it converts, on the backends and
  the engine, and reports into the status.

The controller and the runner meet only through ``contract.RunnerContract`` (the runner Job's
environment) and the status schema. ``kube`` is the Kubernetes client both use. ``h5ngff
operator render`` is the CLI's (``h5ngff.clirender``).
"""
