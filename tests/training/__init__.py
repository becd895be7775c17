"""Fine-tuning tests (issue 6). A package, so that its conftest never shadows tests/conftest.py."""
