"""The optional request path: a reverse proxy in front of llama-server (``--proxy-listen``).

``routes`` classifies a request (pure), ``gate`` holds completion requests
while llama-server is down, loading or being restored (driven by the
engine), ``relay`` forwards and streams, ``listener`` serves it on its own
port. Nothing here is imported unless the proxy is on, except the gate,
which also backs ``/readyz``.
"""
