"""Connector tests (issue 4). A package, so that its conftest never shadows tests/conftest.py."""
