"""The ingress<->engine contract: what crosses between a front end (or the router) and an engine replica."""
