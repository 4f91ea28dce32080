"""Prometheus metrics, and the memory timeline report."""
