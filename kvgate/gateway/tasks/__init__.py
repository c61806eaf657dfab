"""Long generations as MCP tasks (the ``io.modelcontextprotocol/tasks`` extension)."""
