"""Who is in the group: the control plane's membership half (no tensors, no steps).

``Membership`` keeps the members and joiners and drives a ``Pool`` (``WorkerPool``: Ray
actors, one placement group each); ``ElasticPolicy`` makes its decisions. The pool is
imported from ``.pool`` where it is needed, so this package imports without Ray.
"""

from elastic_dp.control.membership.membership import Membership, Pool
from elastic_dp.control.membership.policy import Action, ElasticPolicy, MembershipDecision

__all__ = ["Membership", "Pool", "Action", "ElasticPolicy", "MembershipDecision"]
