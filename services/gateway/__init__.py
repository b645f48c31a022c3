"""The gateway: the OpenAI-compatible HTTP API, the only public port of a moetier cluster.

Text in, text out: it renders the chat template, tokenizes, calls the router's
token-level Generate stream, and detokenizes. `create_app(settings)` builds the app;
`moetier gateway` serves it (services.gateway.server)."""
