"""kvchat over HTTP: the OpenAI-compatible server (`engine serve`), the client session the app uses on any
such server, and the wire vocabulary the two share."""
