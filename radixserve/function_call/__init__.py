"""Tool calls: the text formats models call tools in, the grammar that enforces a call, the streaming parser
that turns a model's text back into OpenAI `tool_calls`, and the chat-template side (docs/structured_outputs.md)."""
