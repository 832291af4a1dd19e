"""Endpoint picker: routes each request to the engine pod that serves it best (not built yet, issue #5)."""
