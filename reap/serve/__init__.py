"""Serving on top of the streaming engine: an OpenAI-compatible HTTP server and chat formatting.

`http` (server and routing) -> `app` (validation, job queue, the worker that owns the model) ->
`backend` (the engine as the worker's backend); `params` parses request fields, `chat` renders
messages with the checkpoint's template or its family's built-in `ChatFormat`, `stream` turns
tokens into text and OpenAI response bodies; `cli` is `reap serve`. The engine never imports this
package.
"""
