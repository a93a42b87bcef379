"""Flow control at the cluster's front: tenants, quotas, priority bands and weighted fair queuing.

Pure logic (no HTTP, no Ray): the Ray ingress and the standalone router each wire a
:class:`~prefixserve.router.flow_control.controller.FlowController` into their request path.
"""
