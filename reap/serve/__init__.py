"""The OpenAI-compatible server on top of the streaming engine (`reap serve`): `http` routes,
`app` queues validated requests for the worker that owns the model, `backend` adapts the engine,
`params` parses request fields, `chat` renders messages (the checkpoint's template or its family's
`ChatFormat`), `stream` turns tokens into text and response bodies, `cli` is the command."""
