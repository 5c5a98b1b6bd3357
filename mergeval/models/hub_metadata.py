"""What a Hugging Face hub model is, read from its small metadata only: before any weight is fetched.

``hub_model(repo_id, field)`` asks the hub (``HF_ENDPOINT``) for the repository's files with their sizes
(``model_info(files_metadata=True)``) and downloads only ``config.json``, or ``adapter_config.json`` for a PEFT
adapter, at the commit that listing named. They go to a temporary directory, not the Hugging Face cache: a cache
holding a repository's configs without its weights would look like a partial download to the offline checks.
No other file (``*.safetensors``, ``*.bin``) is ever requested. The repository is read at its main revision, as
``resolve_source`` reads it. Every failure (no such repository, a gated or private one, no network, a damaged
config) is a one-line ``UserError`` naming the field and the fix.
"""

from __future__ import annotations

import json
import logging
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mergeval.core.errors import UserError
from mergeval.models.adapters import ADAPTER_CONFIG

# What a run downloads of a hub model (resolve_source's allow-patterns, and the `hf download` command check prints).
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]


@dataclass(frozen=True)
class HubModel:
    repo: str
    commit: str | None  # the commit the hub answered for (its main revision)
    files: dict[str, int]  # every file of the repository -> its size in bytes
    download: dict[str, int]  # the files a run downloads (HUB_PATTERNS) -> size
    config: dict | None  # config.json (None for an adapter)
    adapter: dict | None  # adapter_config.json, for a PEFT adapter (adapter_config.json and no config.json)

    @property
    def download_size(self) -> int:
        return sum(self.download.values())

    @property
    def is_adapter(self) -> bool:
        return self.adapter is not None

    @property
    def adapter_base(self) -> str | None:
        """The adapter's ``base_model_name_or_path`` (None for a full model)."""
        return (self.adapter or {}).get("base_model_name_or_path")

    @property
    def quantization(self) -> dict | None:
        found = (self.config or {}).get("quantization_config")
        return found if isinstance(found, dict) else None


def hub_model(repo_id: str, field: str) -> HubModel:
    """``repo_id``'s files, sizes and configs from the hub (module docstring); a UserError for ``field`` when the
    hub cannot answer."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import filter_repo_objects

    where = constants.ENDPOINT
    with _hub_errors(repo_id, field, where):
        info = HfApi().model_info(repo_id, files_metadata=True)
    files = {s.rfilename: s.size if s.size is not None else (s.lfs.size if s.lfs else 0) for s in info.siblings or []}
    download = {name: files[name] for name in filter_repo_objects(files, allow_patterns=HUB_PATTERNS)}
    adapter = ADAPTER_CONFIG in files and "config.json" not in files  # as models/adapters.py's is_adapter
    wanted = ADAPTER_CONFIG if adapter else "config.json" if "config.json" in files else None
    config = _small_json(repo_id, wanted, info.sha, field, where) if wanted else None
    return HubModel(
        repo=repo_id,
        commit=info.sha,
        files=files,
        download=download,
        config=None if adapter else config,
        adapter=config if adapter else None,
    )


def _small_json(repo_id: str, name: str, commit: str | None, field: str, where: str) -> dict:
    from huggingface_hub import hf_hub_download

    with tempfile.TemporaryDirectory(prefix="mergeval-hub-") as tmp:
        with _hub_errors(repo_id, field, where):
            path = Path(hf_hub_download(repo_id, name, revision=commit, local_dir=tmp))
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            doc = err
    if not isinstance(doc, dict):
        raise UserError(
            field,
            f"{name} of {repo_id} on the hub is not a JSON object"
            + (f" ({type(doc).__name__})" if isinstance(doc, Exception) else ""),
            "fix that repository's file, or use another source",
        )
    return doc


# The HTTP libraries the hub client has used (httpx2 in huggingface_hub 2): they log every request at INFO, which
# the command's logging (Hydra's) would print among the check's lines.
_TRANSPORT_LOGGERS = ("httpx", "httpx2")


@contextmanager
def _hub_errors(repo: str, field: str, where: str):
    """The hub client's exceptions inside the block as one-line UserErrors, and its request log quiet. It raises
    several types (its HTTP errors, its transport library's, OSError), so any exception of the hub call counts."""
    loggers = [logging.getLogger(name) for name in _TRANSPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001  (docstring)
        raise _user_error(err, repo, field, where) from None
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _user_error(err: Exception, repo: str, field: str, where: str) -> UserError:
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    if isinstance(err, GatedRepoError):
        return UserError(
            field,
            f"{repo} is gated on the hub",
            "accept its conditions on its hub page, then log in (hf auth login) or set HF_TOKEN",
        )
    if isinstance(err, RepositoryNotFoundError):
        return UserError(
            field,
            f"no repository {repo} on the hub at {where} (or it is private)",
            "check the id (hf:<org>/<name>); for a private repository log in (hf auth login) or set HF_TOKEN",
        )
    if isinstance(err, HFValidationError):
        return UserError(
            field,
            f"'{repo}' is not a hub repository id",
            "write hf:<org>/<name> (mergeval reads a repository's main revision)",
        )
    if isinstance(err, HfHubHTTPError) and err.response is not None:
        return UserError(
            field,
            f"the hub at {where} answered {err.response.status_code} for {repo}",
            "try again later, or check HF_ENDPOINT",
        )
    return UserError(
        field,
        f"cannot reach the hub at {where} for {repo} ({type(err).__name__})",
        "check the network and HF_ENDPOINT, or download the model where there is network and run with offline=true",
    )
