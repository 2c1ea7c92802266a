"""The daemon's Prometheus metrics and what feeds them."""
