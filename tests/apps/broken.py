"""An APP module that raises while it is imported (the CLI must say where, without a traceback)."""

raise RuntimeError("broken on purpose")
