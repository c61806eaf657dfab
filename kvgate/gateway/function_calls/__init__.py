"""Tool calling for every front door: the request's tools and tool choice (``tools``), each
model family's call syntax and the grammar that forces a call (``formats``), and the parser
that reads calls back out of the text, incrementally (``parser``). No HTTP here."""
