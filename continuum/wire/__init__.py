"""Hand-written protocol clients for the hot and streaming paths: HTTP/1.1, SSE, WebSocket."""
