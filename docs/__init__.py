"""Not a package to import: this file gives docs/conftest.py the module name docs.conftest,
so that it and tests/conftest.py (imported by the tests as `conftest`) can share a session."""
