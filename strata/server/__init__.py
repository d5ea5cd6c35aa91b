"""`strata serve`: an OpenAI-compatible HTTP server over the engine, in two processes.

    frontend process (this package, asyncio)          engine process (engine_proc.py)
    FastAPI app ─ openai_api / native_api              Engine: scheduler loop + model
      tokenize, chat template, validate        ZMQ     add / abort requests, step(),
      EngineClient ─ routes outputs to streams ◀────▶  push RequestOutputs back
      metrics, auth, limits                    (io.py: typed msgspec messages)

Files: config.py (ServerConfig), io.py (messages and their codec), engine_proc.py (the engine
process's loop), engine_client.py (the frontend's side of the socket), protocol.py (HTTP request and
response schemas, validation), serving.py (one request's generation: queue limit, collect or stream,
abort on disconnect), openai_api.py (/v1/*), native_api.py (/generate), app.py (the app, auth,
limits, admin endpoints), metrics.py (Prometheus), launch.py (`strata serve`: flags, processes,
signals). docs/SERVING.md is the operator's page.

The frontend never runs the model and never blocks on it; the engine never parses HTTP. Nothing
is pickled on a socket.
"""
