"""What the server offers and how that is shared: the versioned catalog, its config file,
runtime reloads, and the discovery cache (in-process, or shared through Redis)."""
