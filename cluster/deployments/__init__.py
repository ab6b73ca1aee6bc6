"""Ray Serve deployments: the ingress, the pool servers and the application builder."""
