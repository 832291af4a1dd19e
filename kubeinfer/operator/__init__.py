"""kopf operator for InferenceModel resources.

Pure modules (spec in, dicts or decisions out): `spec` (parse and check a spec), `sources` (model and
adapter volumes), `pod_template`, `builders` (Deployment, Service, PDB, InferencePool), `roles`
(active / standby), `placement` (adapters to pods), `status` (conditions), `autoscale`.
Side effects live in `kube` (a small async API client), `reconcile` (apply desired state) and
`handlers` (kopf registrations); `cli` runs it. See docs/operator.md.
"""
