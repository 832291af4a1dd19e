"""kopf operator for InferenceModel resources.

Pure modules (spec in, dicts or decisions out): `spec` (the shared kubeinfer.common.inference_model read
with the operator's checks), `sources` (model and adapter volumes), `pod_template`, `builders` (Deployment, Service, PDB, InferencePool), `roles`
(active / standby), `placement` (adapters to pods), `status` (conditions), `autoscale`.
Side effects live in `kube` (a small async API client), `reconcile` (when passes run, and each pass's steps:
the writes in `owned_objects`, `pod_assignment` and `autoscale_pass`) and `handlers` (kopf registrations);
`cli` runs it. See docs/operator.md.
"""
