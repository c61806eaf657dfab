"""`--model org/name`: a Hugging Face Hub model id resolved to a local snapshot folder.

Resolution goes through `huggingface_hub.snapshot_download`, as vLLM does, so its cache and
environment apply unchanged: `HF_HOME` / `HF_HUB_CACHE` (where snapshots live), `HF_TOKEN`,
`HF_ENDPOINT`, and `HF_HUB_OFFLINE=1` (the cached snapshot of the revision, no network).
Only what the engine reads is fetched (config, tokenizer, chat templates, safetensors), not
a repository's other weight formats. `huggingface_hub` is imported only here, when an id is
given (`pip install 'kvgate[hub]'`; transformers installs it too).
"""

from __future__ import annotations

import re
from pathlib import Path

from kvgate.engine.errors import ModelLoadError

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
ENGINE_FILES = ["*.json", "*.safetensors", "*.jinja", "additional_chat_templates/*.jinja"]


def looks_like_repo_id(model: str) -> bool:
    return REPO_ID.fullmatch(model) is not None and ".." not in model


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local folder of `repo_id` at `revision` (a branch, tag or commit; None: main),
    downloaded into the Hub cache unless already there."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as exc:
        raise ModelLoadError(
            f"model {repo_id!r} is no local folder or file; resolving it as a Hugging Face Hub "
            "id needs huggingface_hub (pip install 'kvgate[hub]')"
        ) from exc
    at = f"{repo_id!r} at revision {revision or 'main'!r}"
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=ENGINE_FILES)
    except RevisionNotFoundError as exc:
        raise ModelLoadError(f"Hub model {at}: no such revision") from exc
    except GatedRepoError as exc:
        raise ModelLoadError(f"Hub model {repo_id!r} is gated: set HF_TOKEN") from exc
    except RepositoryNotFoundError as exc:
        raise ModelLoadError(f"Hub model {repo_id!r} not found (or private: set HF_TOKEN)") from exc
    except LocalEntryNotFoundError as exc:
        raise ModelLoadError(
            f"Hub model {at} is not in the Hub cache and cannot be downloaded "
            f"(offline: HF_HUB_OFFLINE, or no network): {exc}"
        ) from exc
    except (HfHubHTTPError, OSError) as exc:
        raise ModelLoadError(f"Hub model {at}: download failed: {exc}") from exc
    return Path(str(folder))
