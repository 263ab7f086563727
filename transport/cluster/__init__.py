"""A cluster of hosts on one machine (network namespaces on shaped links), for benchmarks and
drills that must cross a network: see hosts.py."""

from transport.cluster.hosts import Cluster, Host, Traffic
from transport.cluster.leftovers import check_rights, clean_leftovers
from transport.cluster.links import Link
from transport.errors import ClusterError

__all__ = ["Cluster", "ClusterError", "Host", "Link", "Traffic", "check_rights", "clean_leftovers"]
