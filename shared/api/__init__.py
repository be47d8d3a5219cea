"""The OpenAI-compatible API: request and response schemas, request preparation and response
building (serving), and the in-process text-in/text-out model (llm, the only module here that
runs the engine; the gateway does not import it)."""
