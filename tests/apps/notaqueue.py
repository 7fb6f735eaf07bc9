"""An APP whose attribute is not a Queue (the CLI must say so)."""

queue = 42
