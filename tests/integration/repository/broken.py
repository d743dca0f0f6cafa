"""A repository file that fails to import: the daemon reports it and serves the others."""

raise RuntimeError("this file is broken on purpose")
