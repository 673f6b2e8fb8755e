"""A real cluster on one machine for tests: hosts in network namespaces with sshd (see cluster.py)."""

from . import faults, packages
from .cluster import Cluster, ClusterUnavailable, free_port, remaining, unavailable_reason
from .netns import Host, leftovers

__all__ = ["Cluster", "ClusterUnavailable", "Host", "faults", "free_port", "leftovers", "packages",
           "remaining", "unavailable_reason"]
