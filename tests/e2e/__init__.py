"""End-to-end tests against a real llama-server and a real model."""
