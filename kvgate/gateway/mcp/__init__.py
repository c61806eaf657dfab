"""The MCP front door (``POST /mcp``): the Streamable HTTP request pipeline, SSE streams,
and the inference tools run on the engine."""
