"""The request path, one module per job (read in this order):

`protocol` (HTTP body -> OpenAI request model, every rejection a 4xx), `auth` (API keys and
scopes), `admission` (bounded per-pool gates: 429 when full, 503 after the wait),
`cluster.routing` (pool choice, a pure function), `dispatch` (Serve handles per pool and pool
status), `streaming` (failover before the first token, error events after it), `errors` (one
table from failures to OpenAI error answers). `cluster.deployments.ingress` wires them together;
`cluster.telemetry` traces them.
"""
