"""The web console: static pages served by the gateway itself (``console.routes``)."""
