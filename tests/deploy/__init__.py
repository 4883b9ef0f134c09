"""The deployment files checked by the tools that read them."""
