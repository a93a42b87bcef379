"""The Ray Serve glue: the request router, its registry, the ingress, the application builder, metrics, drain."""
