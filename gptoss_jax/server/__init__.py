"""The OpenAI-compatible HTTP server over the serving engine: `gptoss-serve`.

errors.py: OpenAI-shaped errors; protocol.py: the request bodies, checked; harmony.py: chat
messages and Responses items into harmony prompts, and a harmony reply back into the APIs' fields;
app.py: the endpoints; cli.py: the command line. docs/serving.md describes the API.
"""
