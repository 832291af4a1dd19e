"""kopf operator for InferenceModel resources (not built yet, issue #6)."""
