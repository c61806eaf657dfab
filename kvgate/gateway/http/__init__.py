"""HTTP plumbing every front door shares: bounded body reads and one-shot or streamed
responses, header limits uvicorn lacks, Origin/Host rules, and serving with a graceful drain."""
