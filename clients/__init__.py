"""Reference clients for Lifeline's gateway (not part of the server: copy or import them)."""
