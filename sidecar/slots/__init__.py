"""The one road by which saves, restores and erases reach llama-server's slots, one at a time."""
