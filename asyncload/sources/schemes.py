"""One spelling of each cloud's URL scheme per source, the other spelling accepted too.

Why: Deep Lake spells Google Cloud Storage and Azure Blob ``gcs://`` and ``azure://``; gsutil, the Azure
tools, fsspec and the object-store source spell them ``gs://`` and ``az://``. Each source takes both and
respells a URL as its own before anything else reads it, so a URL copied from either world works in both,
and one dataset has one name (its node-store key, its state's URL) whichever spelling was typed. The
documentation writes ``gs://`` and ``az://``.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["DEEPLAKE_SCHEMES", "OBJECT_STORE_SCHEMES", "respell"]

#: ``DeepLakeSource``: the object stores' spelling → Deep Lake's.
DEEPLAKE_SCHEMES = {"gs": "gcs", "az": "azure"}
#: ``ObjectStoreSource``: Deep Lake's spelling → the object stores'.
OBJECT_STORE_SCHEMES = {"gcs": "gs", "azure": "az"}


def respell(url: str, spelling: Mapping[str, str]) -> str:
    """``url`` with its scheme respelt by ``spelling`` (``{"gcs": "gs"}``: ``gcs://b/p`` → ``gs://b/p``)."""
    scheme, sep, rest = url.partition("://")
    return f"{spelling[scheme.lower()]}://{rest}" if sep and scheme.lower() in spelling else url
