"""The Kubernetes side of h5ngff: the ConversionJob CRD, the kopf operator, and the runner.

Only ``handlers`` imports kopf, and only ``kube`` (and ``reporter``/``runner_cmd``/``lease``, through
it) imports kubernetes_asyncio, so the pure parts (``manifests``, ``status``, ``reconcile``,
``diagnose``, ``crd``) and
``h5ngff run job.yaml`` work without the ``kubernetes`` extra installed.
"""
