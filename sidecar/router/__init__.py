"""llama-server's router mode: one engine per model behind one server."""
