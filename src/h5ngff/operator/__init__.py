"""The Kubernetes side of h5ngff: the ConversionJob CRD, the kopf operator, and the runner.

Only ``handlers`` imports kopf, and only ``kube``/``reporter``/``runner_cmd`` import
kubernetes_asyncio, so the pure parts (``manifests``, ``status``, ``reconcile``, ``crd``) and
``h5ngff run job.yaml`` work without the ``kubernetes`` extra installed.
"""
