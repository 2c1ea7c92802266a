"""Machines of their own on one Linux host: network namespaces joined by a bridge (namespaces.py), a TCP
fault proxy between them (fault_proxy.py), a private CA (private_ca.py) and the three-machine fleet of
docs/scale_out.md run across them (three_hosts.py). Root only; used by tests/e2e/test_three_hosts.py
and `rollwise bench hosts` (hostile_network.py)."""
