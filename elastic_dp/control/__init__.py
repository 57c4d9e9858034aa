"""The control plane, on the driver: the coordinator (a state machine), membership (pool, placement, policy) and the driver half of each training mode. It holds no tensor."""
