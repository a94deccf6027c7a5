"""Tests that build network namespaces (scripts/netbed.py); they need root and iproute2."""
